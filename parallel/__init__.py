"""The Alpa-derived auto-parallelizer (AlpaServe §4.1) and the model-parallel runtime on Ray actors.

Where things happen, in the order a model goes through them:

* `profiler`       -- per-layer latency / weight / activation bytes; transport sends, collectives (alpha-beta)
* `comm_model`     -- the fitted alpha-beta costs
* `inter_op`       -- DP slicing the layer view into pipeline stages (min max stage latency, memory budget)
* `intra_op`       -- MILP (cvxpy + HiGHS) choosing replicated / column / row per linear layer of a stage
* `configurations` -- every (intra-op degree, pipeline stages) of a group size -> `placement.core.profiles.ProfileSet`
* `plan`           -- `ParallelPlan`: stages and block shardings, the runtime's input
* `tensor_parallel`, `stage_layers` -- shard modules built from the real weights; one (stage, shard)'s layers
* `stage_actor`    -- one Ray actor per (stage, shard)
* `stage_transport` -- torch.distributed point-to-point stage to stage (NCCL between GPUs, gloo elsewhere): a
  request's activations go from actor to actor, not through Ray calls
* `group_runtime`  -- `ModelParallelGroup`: pipelined requests over the actors, failure -> `GroupFailedError`, rebuild
* `tiny_models`    -- random-weight stand-ins for tests
* `python -m parallel profile|configs` -- the CLI
"""

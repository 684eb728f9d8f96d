"""Ray Serve `RequestRouter`s: which replica of one deployment takes a request.

- `model_aware.py`: `ModelAwareRouter`, shortest queue among the group replicas that host the requested model
  (AlpaServe §4.3, the simulator's dispatch policy);
- `polymorph.py`: `PolymorphRouter`, Arlo's multi-level queue (Alg. 1) over a model's runtime replicas;
- `ranking.py`: `RankingRouter`, their common base: Serve's `choose_replicas` around a ranking of the candidates.

Both read only the routing stats named in `rayserve_apps/contracts.py`; neither loads torch.
"""

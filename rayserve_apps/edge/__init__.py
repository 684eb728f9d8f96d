"""The HTTP edge of the ingress: error shapes, body limits, request/response schemas and the standard protocols
(OpenAI embeddings, KServe/Triton v2) over the ingress's own `embed` and `classify`."""

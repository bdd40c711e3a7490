"""`runtime serve`: an OpenAI-compatible HTTP server over the exact methods, with continuous batching.

Layout: `protocol` (request and response bodies, error objects), `text` (response text as tokens
arrive), `fiber` (a request's loop in turns with the worker), `batch` (the forwards loops hand over, and
the one fused forward per step), `scheduler` (the worker that decodes every admitted request), `metrics` (Prometheus text), `app` (the FastAPI routes) and `server`
(uvicorn beside the scheduler). docs/serving.md describes what the server promises and how.
"""

"""`omnirun serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

`create_app(llm, ...)` (an LLM, or an EngineProcess) builds the application; `omnirun serve` runs it with uvicorn.
Needs the `serve` extra (fastapi, uvicorn, prometheus-client), imported only when the server is used.
"""

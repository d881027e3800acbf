"""`omnirun serve`: the engine's flags plus the server's, then uvicorn until Ctrl-C, SIGTERM or the engine's death
(then exit status 1, for a supervisor to restart the server)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omnirun.errors import OmnirunError
from omnirun.server.watchdog import ENGINE_DIED_EXIT, EngineWatchdog

logger = logging.getLogger(__name__)


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    from omnirun.cli_flags import add_runner_flags
    from omnirun.server.tool_parsers import TOOL_PARSERS

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (the embedded model by default)")
    add_runner_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    serve.add_argument("--api-key", default=None, help="when set, /v1 requests must send 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests that may wait for their first token; more get 503 with Retry-After (default: no limit)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body accepted, in bytes; a larger one gets 413 before it is parsed (default: 8 MiB)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format of the model's tool calls, read out of chat output when a request sends tools (hermes: "
        "Qwen2.5/Qwen3, llama3_json: Llama 3.1/3.2, mistral: Mistral v0.3); default: none, and chat requests with "
        "tools get 400 unless tool_choice is 'none'",
    )
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="step the engine in a thread of the server's process, not in a process of its own (the default, "
        "which keeps HTTP work off the engine's GIL)",
    )
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from omnirun.cli_flags import llm_kwargs
    from omnirun.engine import LLM
    from omnirun.engine.process import EngineProcess
    from omnirun.engine.tokenizer import tokenizer_dir
    from omnirun.registry import select_platform
    from omnirun.server.app import create_app
    from omnirun.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
    from omnirun.server.summary import engine_description, summary_line

    if not 0 <= args.port <= 65535:
        raise OmnirunError(f"--port {args.port} is not a TCP port: use 0..65535")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise OmnirunError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise OmnirunError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.api_key is not None and not args.api_key:
        raise OmnirunError("--api-key is empty: give a key, or leave the flag out for no key")
    platform = select_platform(args.device)  # an unusable device fails here, in one line, before anything loads
    model = args.model
    if model is None:
        from omnirun.assets.default_model import default_model_dir

        model = default_model_dir()
    # (a path that is no model is the engine's one-line error, not a tokenizer warning first)
    if (Path(model).is_dir() or args.load_format == "dummy") and tokenizer_dir(args.tokenizer, model) is None:
        logger.warning(
            "%s has no tokenizer: serving token-id prompts on /v1/completions only, with empty text (pass "
            "--tokenizer <HF tokenizer dir> for text)",
            model,
        )
    logging.getLogger("omnirun.server").setLevel(args.log_level.upper())  # (the start-up line is at info)
    served_name = args.served_model_name or (args.model or "default")
    # In a thread the engine uses the Platform resolved above; a spawned engine process resolves its name again.
    kwargs = llm_kwargs(args)
    if args.engine_in_thread:
        engine = LLM(model, **{**kwargs, "device": platform})
    else:
        engine = EngineProcess(model, **{**kwargs, "device": platform.name})
    with engine:
        app = create_app(
            engine,
            served_model_name=served_name,
            api_key=args.api_key,
            max_queued_requests=args.max_queued_requests,
            max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
            tool_call_parser=args.tool_call_parser,
        )
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
        server = uvicorn.Server(config)
        sock = config.bind_socket()  # bound here, so that the line below names the port (--port 0: the OS's pick)
        logger.info("%s", summary_line(served_name, model, engine_description(engine), _address(args.host, sock)))
        watchdog = EngineWatchdog(app.state.server.engine.client, server)
        with _closing_on_sigterm(engine, watchdog), watchdog:
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn raises a captured Ctrl-C again once it has stopped
                pass
    if watchdog.death is not None:
        return ENGINE_DIED_EXIT
    return 0 if server.started else 1


def _address(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def _closing_on_sigterm(engine: Any, watchdog: EngineWatchdog) -> Iterator[None]:
    """uvicorn stops on SIGTERM and then raises the signal again, which would end this process before the engine
    is closed (an engine process left to notice its parent's death): close it first, then die of the signal."""

    def close_then_die(signum: int, frame: Any) -> None:
        watchdog.stop()  # closing the engine on purpose is no death to report
        engine.close()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    previous = signal.signal(signal.SIGTERM, close_then_die)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

"""``digen reward-server``: a reward model served over HTTP."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import click

from cli._shared import refuse, user_errors


@click.command("reward-server")
@click.option(
    "--reward", required=True, help="A built-in, module:function or path/to/file.py:function."
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port; 0 picks a free one.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--options",
    "options_text",
    default=None,
    help="Keyword arguments for a reward that is a class, as YAML/JSON: '{model_dir: /m}'.",
)
@click.option(
    "--max-body-mib", type=int, default=256, show_default=True, help="Largest request body, MiB."
)
@click.option(
    "--max-samples", type=int, default=256, show_default=True, help="Most samples a request."
)
@click.option(
    "--max-frames", type=int, default=256, show_default=True, help="Most frames a sample."
)
@click.option(
    "--max-pixels",
    type=int,
    default=1 << 26,
    show_default=True,
    help="Most pixels a request (samples x frames x height x width), checked before decoding.",
)
@click.option(
    "--max-concurrent",
    type=int,
    default=4,
    show_default=True,
    help="Requests read, decoded and scored at once.",
)
@click.option(
    "--max-queued",
    type=int,
    default=64,
    show_default=True,
    help="Requests waiting for a slot; one more is answered 429.",
)
@click.option(
    "--read-timeout-s",
    type=int,
    default=60,
    show_default=True,
    help="Seconds a request may take to arrive (headers, then body); a slower client is dropped.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A bearer token POST /score must carry, in a file  [default: the environment "
    "variable DIGEN_REWARD_TOKEN, else none]",
)
@click.option(
    "--debug",
    is_flag=True,
    help="Send a failing reward's error text to the client, not only the log.",
)
@user_errors
def reward_server(
    reward: str,
    port: int,
    host: str,
    options_text: str | None,
    token_file: Path | None,
    debug: bool,
    **limits: int,
) -> None:
    """Serve a reward over HTTP (POST /score, GET /health); see docs/REWARD_SERVER.md."""

    import yaml

    from digen.rewards.server import TOKEN_ENV, ServerLimits, check_token, serve

    try:
        options = yaml.safe_load(options_text) if options_text else {}
    except yaml.YAMLError:
        options = None
    if not isinstance(options, dict):
        refuse(f"--options must be a mapping such as '{{size: 2}}', not {options_text!r}.")

    token = os.environ.get(TOKEN_ENV, "").strip() or None
    where = f"the environment variable {TOKEN_ENV}"
    try:
        if token_file is not None:
            where = f"--token-file {str(token_file)!r}"
            token = token_file.read_text(encoding="utf-8").strip()
        if token is not None:
            check_token(token, where)
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        refuse(f"{where} cannot be read: {why.lower()}.")

    def ready(url: str) -> None:
        guard = "; POST /score needs the bearer token" if token else ""
        click.echo(f"serving reward {reward!r} on {url} (GET /health){guard}; Ctrl-C stops it")

    # The server's log (a failing reward's traceback, undecodable requests) goes to stderr.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("digen.rewards.server").addHandler(handler)
    asyncio.run(serve(reward, host, port, ready, options, ServerLimits(**limits), debug, token))

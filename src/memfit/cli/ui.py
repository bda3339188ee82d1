"""``memfit ui``: the local page (``memfit.ui``): estimate, plan, trainers' configs and serving plan."""

from __future__ import annotations

from memfit.cli import _args
from memfit.errors import MemfitError


def build(parser) -> None:
    server = _args.section(parser, "server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to serve on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    server.add_argument("--port", type=_args.positive, default=7860, metavar="N", help="port to serve on (default 7860)")
    server.add_argument("--share", action="store_true",
                        help="also a public gradio.live link (default off: anyone with the link can use the page)")


def run(args) -> int:
    from importlib.util import find_spec

    from memfit.ui.app import INSTALL, launch

    if find_spec("gradio") is None:
        raise MemfitError(INSTALL)
    launch(args.host, args.port, share=args.share)
    return 0

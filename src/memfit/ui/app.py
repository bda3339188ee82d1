"""``memfit ui``: the estimate, the plan, its trainers' configs and the serving plan on one local page.

The page is a Gradio ``Blocks``: Hugging Face Spaces run Gradio, so the repository's ``app.py`` (three
lines over ``build_app``) deploys this page as a Space unchanged. Gradio is imported when the page is
built, not when this module is (``pip install 'memfit[ui]'``; ``memfit ui`` says so in one line).

Written by hand, because Gradio lays out what it is told to: the form (a model by catalog name, Hub id
or uploaded config.json; a card and a budget; batch and sequence length; the techniques) and where
each answer goes. Each button is one endpoint (``/estimate``, ``/plan``, ``/serve``), called by
``gradio_client`` exactly as the page calls it. The queries and what the process keeps between them
are ``answers.py``, the text ``views.py``; the timeline is ``memfit estimate --html``'s own page, shown
in a frame. An error is one line above the answers, ``MemfitError``'s own; anything else is a bug:
its traceback goes to the server's log and the page says so in one line.

``build_app`` starts one thread that imports torch, transformers and memfit's estimator and traces a
tiny step, so that the first answer does not pay for them (about 8 s on 2 cores); after that a catalog
model's estimate takes one or two seconds, and a repeated query none (``answers.MAX_CACHED``).

Left out: the command line's parallel runs (``--gpus``, ``--tp``, ``--device-map``) and ``--from``; what
would run code or read files on the server, which may be a public Space (``package.module:function``
models, ``trust_remote_code``, paths: a config.json is uploaded); more than one trace at a time.
"""

from __future__ import annotations

import logging
import threading

from memfit.errors import MemfitError
from memfit.ui.answers import Answers
from memfit.ui.views import (SIZE_HEADERS, configs_text, error_line, estimate_text, plan_text, serve_text,
                             size_rows)

__all__ = ["build_app", "launch", "main", "INSTALL", "DEFAULTS"]

INSTALL = "memfit ui needs Gradio: pip install 'memfit[ui]'"
# the form's first values: Llama-3.1-8B on an RTX 4090, the README's example
DEFAULTS = {"model": "llama-3.1-8b", "gpu": "rtx-4090", "batch_size": 8, "seq_len": 2048, "context": 8192}
WARM_MODEL = "gpt2"  # traced once at start (8 tokens): the imports and torch's first dispatches, paid early
FRAME = ('<iframe src="gradio_api/file={path}#memfit-timeline" title="memory timeline" '
         'style="width:100%;height:1150px;border:0"></iframe>')
INTRO = ("## memfit: will this training step fit?\n"
         "One step traced on fake tensors (no GPU, no memory): the verdict on your card, where the bytes go, "
         "the fastest recipe that fits, its trainers' configs, and how many requests a card serves.")
log = logging.getLogger("memfit.ui")


def _gradio():
    try:
        import gradio
    except ImportError:
        raise MemfitError(INSTALL) from None
    return gradio


def build_app(answers: Answers | None = None, *, warm: bool = True):
    """The page, ready to ``launch()``; ``answers`` keeps what the process knows (default: a new one)."""
    gr = _gradio()
    answers = answers or Answers()
    gr.set_static_paths([str(answers.pages)])  # the timeline pages, and nothing else of the folder
    if warm:
        threading.Thread(target=answers.warm, args=(WARM_MODEL,), name="memfit-ui-warm", daemon=True).start()
    with gr.Blocks(title="memfit", analytics_enabled=False) as demo:  # a local tool tells no one what it answers
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=1, min_width=340):
                form, plan_form, serve_form = _form(gr)
            with gr.Column(scale=2):
                with gr.Row():  # above the answers: the form is longer than a screen
                    buttons = [gr.Button(text, variant="primary" if text == "estimate" else "secondary",
                                         elem_id=f"memfit-{text}") for text in ("estimate", "plan", "serve")]
                error = gr.Markdown(elem_id="memfit-error")
                outputs, tabs = _answers_area(gr)
        _wire(gr, answers, buttons, tabs, error, outputs, form, plan_form, serve_form)
    return demo


def _form(gr):
    """The inputs: the step (model, card, budget, batch, length, techniques), then the plan's and the serving's."""
    from memfit.hardware.gpus import CATALOG as CARDS
    from memfit.models.catalog import CATALOG as MODELS
    from memfit.planner.space import allowable
    from memfit.generation.serve import FORMATS
    from memfit.techniques.registry import fields

    field = {f.name: f for f in fields()}
    form = [gr.Dropdown(list(MODELS), value=DEFAULTS["model"], allow_custom_value=True, label="model",
                        info="a catalog name, a Hugging Face Hub id (owner/name: its config.json only)"),
            gr.File(label="or a config.json", file_types=[".json"], type="filepath", height=110),
            gr.Dropdown(list(CARDS), value=DEFAULTS["gpu"], allow_custom_value=True, label="card",
                        info="a GPU of the catalog (its memory, speeds and CUDA semantics)"),
            gr.Textbox(label="budget", placeholder="the card's memory; or e.g. 20GiB",
                       info="what the process may use on the card, CUDA context included"),
            gr.Number(DEFAULTS["batch_size"], label="batch size", info="examples per optimizer step"),
            gr.Number(DEFAULTS["seq_len"], label="sequence length", info="tokens per example; 0: the model's")]
    with gr.Accordion("techniques", open=True):
        form += [gr.Radio(list(field["precision"].choices), value="fp32", label="precision"),
                 gr.Dropdown(["off", "selective", "blocks", "blocks:2"], value="off", allow_custom_value=True,
                             label="activation checkpointing", info=field["checkpointing"].help),
                 gr.Dropdown(list(field["optimizer"].choices), value="adamw", allow_custom_value=True,
                             label="optimizer"),
                 gr.Dropdown(["off", "lora", "qlora", "lora:64", "qlora:64"], value="off", allow_custom_value=True,
                             label="LoRA", info=field["lora"].help),
                 gr.Checkbox(label="offload activations to the host"),
                 gr.Checkbox(label="optimizer step in backward")]
    with gr.Accordion("plan: techniques that change the math, allowed", open=False):
        plan_form = [gr.CheckboxGroup(list(allowable()), label="allow")]
    with gr.Accordion("serving", open=False):
        serve_form = [gr.Number(DEFAULTS["context"], label="context", info="tokens per request, prompt + output"),
                      gr.CheckboxGroup([f for f in FORMATS if f != "bf16"], label="weight formats beside bf16")]
    return form, plan_form, serve_form


TECHNIQUES = ("precision", "checkpointing", "optimizer", "lora", "offload_activations", "optimizer_in_backward")


def _answers_area(gr):
    """The tabs the answers go to: {name: component}, and the Tabs (a button shows its own tab)."""
    with gr.Tabs() as tabs:
        with gr.Tab("estimate", id="estimate"):
            verdict = gr.Markdown(elem_id="memfit-verdict")
            sizes = gr.Dataframe(headers=SIZE_HEADERS, datatype=["str", "str", "number", "str"], interactive=False,
                                 label="at the peak, by category", elem_id="memfit-sizes")
            timeline = gr.HTML(elem_id="memfit-timeline-frame")
        with gr.Tab("plan", id="plan"):
            planned = gr.Markdown(elem_id="memfit-plan")
        with gr.Tab("configs", id="configs"):
            configs = gr.Markdown(elem_id="memfit-configs")
        with gr.Tab("serving", id="serve"):
            served = gr.Markdown(elem_id="memfit-serve")
    outputs = {"verdict": verdict, "sizes": sizes, "timeline": timeline, "plan": planned, "configs": configs,
               "serve": served}
    return outputs, tabs


def _wire(gr, answers: Answers, buttons, tabs, error, out, form, plan_form, serve_form) -> None:
    """Each button: its tab shown at once, then its answer (one traced at a time, ``concurrency_id``)."""
    estimate, plan, serve = _handlers(gr, answers)
    routes = ((estimate, "estimate", [], [out["verdict"], out["sizes"], out["timeline"]]),
              (plan, "plan", plan_form, [out["plan"], out["configs"]]),
              (serve, "serve", serve_form, [out["serve"]]))
    for button, (fn, name, extra, targets) in zip(buttons, routes):
        button.click(lambda name=name: gr.Tabs(selected=name), None, tabs, queue=False, api_visibility="private")
        button.click(fn, form + extra, [error] + targets, api_name=name, concurrency_id="memfit",
                     concurrency_limit=1)


def _handlers(gr, answers: Answers):
    """The three endpoints: the form's values in, (the error line, the answers...) out."""
    def estimate(*values, progress=gr.Progress()):
        def run():
            q = _query(answers, values)
            report = answers.estimate(q, progress=_ticks(progress))
            return (estimate_text(report, q.name, q.recipe), size_rows(report),
                    FRAME.format(path=answers.timeline(q)))
        return _answered(run, ("", [], ""))

    def plan(*values, progress=gr.Progress()):
        def run():
            q = _query(answers, values[:-1])
            plans = answers.plan(q, tuple(values[-1] or ()), progress=_ticks(progress))
            return plan_text(plans, q.name), _configs(plans, q)
        return _answered(run, ("", ""))

    def serve(*values):
        def run():
            q = _query(answers, values[:-2])
            return (serve_text(answers.serve(q, values[-2], tuple(values[-1] or ())), q.name),)
        return _answered(run, ("",))

    return estimate, plan, serve


def _query(answers: Answers, values):
    model, upload, gpu, budget, batch_size, seq_len, *techniques = values
    return answers.query(model, upload, gpu, budget, batch_size, seq_len, **dict(zip(TECHNIQUES, techniques)))


def _configs(plans, q) -> str:
    """The configs tab: emitted for the chosen recipe; its own error line where they cannot be."""
    try:
        return configs_text(plans, None if q.path else q.source, q.seq_len)
    except MemfitError as err:
        return error_line(err)


def _ticks(progress):
    """memfit's ``progress(done, total)`` as Gradio's bar."""
    return lambda done, total: progress((done, total), desc="tracing on fake tensors")


def _answered(run, blanks: tuple) -> tuple:
    """("", the answers...) or (the error's one line, blanks...)."""
    try:
        return ("", *run())
    except MemfitError as err:
        return (error_line(err), *blanks)
    except Exception as err:  # noqa: BLE001 — a bug: the log has the traceback, the page one line
        log.exception("memfit ui: an answer failed")
        return (error_line(MemfitError(f"internal error ({type(err).__name__}: {err}), a bug in memfit: the "
                                       "server's log has the traceback")), *blanks)


def launch(host: str | None = "127.0.0.1", port: int | None = 7860, *, share: bool = False, block: bool = True,
           answers: Answers | None = None):
    """Build the page and serve it on ``host:port`` (None: Gradio's default or its environment variables);
    ``share``: also through a public gradio.live link. ``block=False`` returns the running Blocks at once
    (``close()`` stops it)."""
    demo = build_app(answers)
    try:
        _, local, public = demo.launch(server_name=host, server_port=port, share=share, prevent_thread_lock=True,
                                       show_error=False, quiet=True)
    except OSError as err:  # Gradio's own text names its launch() arguments: the first sentence is the cause
        raise MemfitError(f"cannot serve on {host}:{port} ({str(err).split('. ')[0]}): pass another --port") from None
    print(f"memfit ui: serving on {local}" + (f" and {public}" if public else "")
          + (" (Ctrl-C stops it)" if block else ""), flush=True)
    if block:
        demo.block_thread()
    return demo


def main() -> None:
    """``python -m memfit.ui.app``: the page on Gradio's default address (``GRADIO_SERVER_NAME``/``_PORT``)."""
    launch(None, None)


if __name__ == "__main__":
    main()

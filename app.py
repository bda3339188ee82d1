"""Hugging Face Spaces' entry (a Gradio Space runs ``python app.py``): the page of ``memfit ui``."""
from memfit.ui.app import build_app

demo = build_app()
if __name__ == "__main__":
    demo.launch()

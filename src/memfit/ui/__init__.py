"""``memfit ui``: a local page (Gradio) over the public API: estimate, plan, trainers' configs, serving.

``app.py`` lays the page out and serves it (``build_app``, ``launch``), ``answers.py`` reads the form and
keeps the answers between requests, ``views.py`` writes them as the page's text. Gradio is imported only
when the page is built (``pip install 'memfit[ui]'``): importing any of these modules needs none.
"""

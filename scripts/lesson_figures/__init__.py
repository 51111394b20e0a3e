"""The lessons' pictures, one module per lesson (``lNN_<topic>.py``), collected by scripts/make_figures.py.

Each module defines ``FIGURES = {name: (draw, source)}``: ``draw(path)`` writes the PNG, ``source`` is the committed
result a measured figure reads (``None`` for a diagram drawn from code). Names start with the lesson's number, so
``lessons/figures/`` sorts by lesson. Shared drawing helpers live in ``draw.py``.
"""

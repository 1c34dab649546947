"""The paper's analyses (Figures 2, 4/5, 8-16, Table 3) measured on a real model and real text.

* ``statistics``: the numbers behind them, on captured keys, queries and attention (plain tensors).
* ``figures`` / ``table3``: the entry points, ``python -m keydiff.analysis.figures`` and
  ``python -m keydiff.analysis.table3`` (``make analysis``), configured by conf/analysis.yaml.
* ``future_attention``: how well attention-free scores predict the attention of later queries.
* ``common``: config loading and checks, prompts, provenance and saving shared by the entry points.
"""

"""Benchmark tasks: each builds its samples offline (or from the Hub where asked) and scores predictions
as its official evaluator does.

    base.py               the contract between a task and the runner
    niah.py               Needle-in-a-Haystack
    haystack.py           the offline haystack text (pinned in data/, with its licence and hash)
    longbench.py          LongBench v1 / LongBench-E, as the official pred.py and eval.py
    longbench_metrics.py  LongBench's metrics, as the official metrics.py
    math500.py            Math-500 with the DeepSeek-R1 prompt and sampled decoding
    math_answers.py       Math-500's answer extraction, Exact Match and Flex Match
    phonebook.py          Phonebook lookup
    ruler.py              RULER's 13 tasks, generated offline
    ruler_generators.py   RULER's synthetic generators
    ruler_qa.py           RULER's QA tasks (SQuAD, HotpotQA)
    ruler_shared.py       several questions over one RULER context
    degenerate.py         collapsed generations: one token or short n-gram repeated over most of an output
    fixture_builders/     the code that writes the made-up offline fixtures under tasks/fixtures/
"""

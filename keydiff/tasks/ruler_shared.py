"""Several questions over one context: a RULER multi-key haystack holding k needles, one question per needle,
asked as separate requests from one compressed context (multi_request) or as one conversation (multi_turn).

Design: docs/design/tasks.md#several-questions-over-one-context
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from keydiff.tasks.base import GenerationSettings, Prompt, Sample, SharedContext, Task, split_encode
from keydiff.tasks.ruler import (GENERATOR_VERSION, MIN_LENGTH_FRACTION, fit_size, load_essay, postprocess,
                                string_match_all)
from keydiff.tasks.ruler_generators import (
    DEPTHS,
    NEEDLE,
    QUESTION_MARKERS,
    RULER_COMMIT,
    TEMPLATES,
    Niah,
    random_value,
    sub_seed,
    wonderwords_sources,
)

MODES = ("independent", "multi_request", "multi_turn")
HAYSTACKS = ("essay", "noise", "needle")
VALUE_TYPES = ("words", "numbers", "uuids")
# Placeholders rendered through the chat template to find the text between an answer and the next question.
_ANSWER, _QUESTION = "KEYDIFFANSWERPLACEHOLDER", "KEYDIFFQUESTIONPLACEHOLDER"


def singular(text: str) -> str:
    """RULER's rewrite of the niah template for one value asked (num_q x num_v = 1)."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


@dataclass
class RulerShared(Task):
    """k needles in one RULER haystack, k questions over it (module docstring)."""

    name: str = "shared_ruler_4k"
    length: int = 4096
    questions: int = 4  # k: needles in each context, one question each
    mode: str = "independent"  # independent | multi_request | multi_turn
    num_contexts: int = 100
    limit: int | None = None  # the first `limit` contexts (each with its k questions)
    seed: int = 42
    haystack: str = "essay"  # RULER's niah haystacks: essay (niah_multikey_1), noise, needle (distractor needles)
    type_k: str = "words"
    type_v: str = "numbers"
    haystack_dir: str | None = None  # essay: a folder of .txt essays or RULER's PaulGrahamEssays.json; None: pydoc
    haystack_source: str = "pinned"  # the pydoc prose: "pinned" (the repository's) or "interpreter" (this Python's)
    chat_template: bool = True
    max_new_tokens: int | None = None  # None: RULER's niah tokens to generate (128)

    _essay: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _essay_sources: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    _essay_kind: str | None = field(default=None, init=False, repr=False, compare=False)
    _built: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    context_split: ClassVar[str | None] = ("before the question, \"What is the special magic\" (RULER's niah split as "
                                           "kvpress makes it); follow-up turns (multi_turn) are held whole")

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"task.mode={self.mode!r} is not valid; valid: {', '.join(MODES)}")
        for key in ("length", "questions", "num_contexts"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"task.{key}={value!r} is not valid; valid: a positive integer")
        if self.questions > len(DEPTHS):
            raise ValueError(f"task.questions={self.questions} is not valid; valid: 1 to {len(DEPTHS)} "
                             "(RULER's depths)")
        limit = self.limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"task.limit={self.limit!r} is not valid; valid: null or a positive integer (contexts)")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise ValueError(f"task.max_new_tokens={self.max_new_tokens!r} is not valid; valid: null (RULER's 128) "
                             "or a positive integer")
        from keydiff.tasks.haystack import check_source

        check_source(self.haystack_source)
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"task.haystack={self.haystack!r} is not valid; valid: {', '.join(HAYSTACKS)}")
        for key in ("type_k", "type_v"):
            if getattr(self, key) not in VALUE_TYPES:
                raise ValueError(f"task.{key}={getattr(self, key)!r} is not valid; valid: {', '.join(VALUE_TYPES)}")

    def check_model(self, max_length: int | None) -> None:
        """task.length against the model's context; in multi_turn also the conversation, up to length + (k - 1) x
        tokens to generate before the follow-up turns (which shared_context counts exactly)."""
        if max_length is None:
            return
        if self.length > max_length:
            raise ValueError(f"task.length={self.length} exceeds the model's max_length ({max_length}); use a shorter "
                             "length or a model with a longer context")
        if self.mode == "multi_turn":
            to_generate = self.tokens_to_generate()
            longest = self.length + (self.questions - 1) * to_generate
            if longest > max_length:
                raise ValueError(
                    f"{self.name}: a multi-turn conversation of task.questions={self.questions} can reach "
                    f"{longest} tokens before its follow-up turns (task.length={self.length} + "
                    f"{self.questions - 1} more answers x {to_generate} new tokens), over model.max_length="
                    f"{max_length}; use fewer task.questions, a shorter task.length or a larger model.max_length")

    def _essay_words(self) -> tuple[str, ...]:
        if self._essay is None:
            self._essay, self._essay_sources, self._essay_kind = load_essay(self.haystack_dir, self.haystack_source)
        return self._essay

    def generator(self) -> Niah:
        essay = self._essay_words() if self.haystack == "essay" else ()
        return Niah(haystack=self.haystack, type_k=self.type_k, type_v=self.type_v, num_k=self.questions, essay=essay)

    def plan(self, context: int) -> dict[str, Any]:
        """Keys, values, needles and depths of context `context` (no tokenizer): pairs drawn one after another from
        one stream, so the first k are the same for every k; values distinct from each other and from the keys."""
        rng = random.Random(sub_seed("ruler_shared", self.seed, self.length, context))
        keys: list[str] = []
        values: list[str] = []
        while len(keys) < self.questions:
            key, value = random_value(self.type_k, rng), random_value(self.type_v, rng)
            if key in keys or value in values or key in values or value in keys:
                continue
            keys.append(key)
            values.append(value)
        depths = list(DEPTHS)
        random.Random(sub_seed("ruler_shared/depths", self.seed, self.length, context)).shuffle(depths)
        return {
            "seed": sub_seed("ruler_shared/haystack", self.seed, self.length, context),
            "keys": keys,
            "values": values,
            "needles": [NEEDLE.format(type_needle_v=self.type_v, key=k, value=v) for k, v in zip(keys, values)],
            "depths": depths[: self.questions],
        }

    def asking_order(self, context: int) -> list[int]:
        """The needles of context `context` in the order they are asked: a shuffle from its own stream (seed,
        length, context), so it depends neither on the placement's draws nor on where the needles sit."""
        order = list(range(self.questions))
        random.Random(sub_seed("ruler_shared/asking_order", self.seed, self.length, context)).shuffle(order)
        return order

    def contexts(self) -> int:
        return self.num_contexts if self.limit is None else min(self.num_contexts, self.limit)

    def samples(self) -> Iterator[Sample]:
        for context in range(self.contexts()):
            plan = self.plan(context)
            for j, needle in enumerate(self.asking_order(context)):
                yield Sample(id=f"c{context}/q{j}", fields={"context": context, "question": j, "needle": needle,
                                                            "key": plan["keys"][needle],
                                                            "answers": [plan["values"][needle]],
                                                            "questions": self.questions})

    def shard_group(self, sample: Sample) -> str:
        """A context's questions stay together (they share its prefill in the shared modes)."""
        return f"c{sample.fields['context']}"

    def tokens_to_generate(self) -> int:
        return self.max_new_tokens or TEMPLATES["niah"]["tokens_to_generate"]

    def question_text(self, key: str) -> tuple[str, str]:
        """(the question, the answer prefix with its leading space) asking for `key`."""
        template, prefix = TEMPLATES["niah"]["template"], TEMPLATES["niah"]["answer_prefix"]
        question = singular(template.split("{context}\n", 1)[1]).format(type_needle_v=self.type_v[:-1], query=key)
        return question, singular(prefix).format(type_needle_v=self.type_v[:-1], query=key)

    def _templated(self, tokenizer: Any) -> bool:
        return bool(self.chat_template and getattr(tokenizer, "chat_template", None))

    def render(self, tokenizer: Any, plan: dict[str, Any], size: int, key: str) -> tuple[str, bool]:
        """(the rendered prompt asking for `key`, add_special_tokens): RULER's niah template in one user turn, the
        answer prefix after the generation prompt (keydiff.tasks.ruler's layout)."""
        header = singular(TEMPLATES["niah"]["template"].split("{context}", 1)[0]).format(type_needle_v=self.type_v[:-1])
        question, prefix = self.question_text(key)
        user = header + self.generator().context(plan, size) + "\n" + question
        if self._templated(tokenizer):
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                     add_generation_prompt=True, enable_thinking=False)
            return rendered + prefix, False
        return user + prefix, True

    def build(self, context: int, tokenizer: Any) -> dict[str, Any]:
        """Everything about context `context` for this tokenizer: the fitted haystack size, each needle's question's
        rendered prompt (in needle order), where the question starts, and each needle's depth rank (0: the
        shallowest, from where it sits in the rendered context) and RULER depth (essay; cached per context)."""
        cache_key = (context, id(tokenizer))
        if cache_key in self._built:
            return self._built[cache_key]
        plan = self.plan(context)
        to_generate = self.tokens_to_generate()

        def measure(size: int) -> int:
            prompts = (self.render(tokenizer, plan, size, key) for key in plan["keys"])
            longest = max(len(tokenizer(text, add_special_tokens=special)["input_ids"]) for text, special in prompts)
            return longest + to_generate

        gen = self.generator()
        try:
            size = fit_size(measure, self.length, gen.min_size(plan), gen.max_size(plan))
        except ValueError as error:
            raise ValueError(f"{self.name} at task.length={self.length}: {error}; use a larger length") from None
        rendered = [self.render(tokenizer, plan, size, key) for key in plan["keys"]]
        splits = [list(QUESTION_MARKERS["niah"].finditer(text))[-1].start() for text, _ in rendered]
        prefixes = {text[:split] for (text, _), split in zip(rendered, splits)}
        assert len(prefixes) == 1, "the context must not depend on the question"
        context_text = rendered[0][0][: splits[0]]
        starts = [context_text.index(needle) for needle in plan["needles"]]
        depth_ranks = [sorted(starts).index(start) for start in starts]
        # essay: needle i is placed at the i-th smallest depth (Niah.context); other haystacks place them at random
        depths = sorted(plan["depths"]) if self.haystack == "essay" else [None] * len(starts)
        built = {"plan": plan, "size": size, "rendered": rendered, "split": splits[0], "special": rendered[0][1],
                 "depth_ranks": depth_ranks, "depths": depths}
        self._built = {cache_key: built}  # one context at a time: the runner asks for a context's questions together
        return built

    def info(self, sample: Sample, built: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
        fraction = (prompt_tokens + self.tokens_to_generate()) / self.length
        needle = sample.fields["needle"]
        return {"context_id": sample.fields["context"], "question_index": sample.fields["question"],
                "needle_index": needle, "depth_rank": built["depth_ranks"][needle], "depth": built["depths"][needle],
                "questions": self.questions, "mode": self.mode, "key": sample.fields["key"],
                "haystack": self.haystack_kind(), "haystack_size": built["size"], "length": self.length,
                "length_fraction": round(fraction, 4), "short": fraction < MIN_LENGTH_FRACTION,
                "answers": list(sample.fields["answers"])}

    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None, query_aware: bool = True) -> Prompt:
        """Question j over its context: the whole prompt (query_aware=True) or context and question tokenised apart
        with `context_tokens` set (query_aware=False, kvpress's split; the shared modes' prompts are these)."""
        built = self.build(sample.fields["context"], tokenizer)
        text, special = built["rendered"][sample.fields["needle"]]
        if query_aware:
            ids, context_tokens = list(tokenizer(text, add_special_tokens=special)["input_ids"]), None
        else:
            ids, context_tokens = split_encode(tokenizer, text, built["split"], special)
        if max_length is not None and len(ids) > max_length:
            raise ValueError(f"{self.name} {sample.id}: prompt of {len(ids)} tokens exceeds the model's max_length "
                             f"{max_length}")
        return Prompt(ids, GenerationSettings(max_new_tokens=self.tokens_to_generate()),
                      self.info(sample, built, len(ids)), context_tokens=context_tokens)

    def turn_texts(self, tokenizer: Any) -> tuple[str, str]:
        """(what closes an answer and opens the next user turn, what follows that turn's content): the chat
        template's text around a second user message, or a newline and nothing without a template."""
        if not self._templated(tokenizer):
            return "\n", ""
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "context"}, {"role": "assistant", "content": _ANSWER},
             {"role": "user", "content": _QUESTION}], tokenize=False, add_generation_prompt=True, enable_thinking=False)
        if rendered.count(_ANSWER) != 1 or rendered.count(_QUESTION) != 1:
            raise ValueError(f"{self.name}: the chat template rewrote a turn, so a follow-up question cannot be placed "
                             "(task.mode=multi_turn); use task.chat_template=false or another mode")
        between = rendered[rendered.index(_ANSWER) + len(_ANSWER): rendered.index(_QUESTION)]
        return between, rendered[rendered.index(_QUESTION) + len(_QUESTION):]

    def shared_context(self, samples: list[Sample], tokenizer: Any, max_length: int | None) -> SharedContext:
        """The context of `samples` (one context's questions, in asking order), each question's prompt and follow-up
        turn ids (multi_turn: the longest conversation must fit max_length, refused before any decoding)."""
        prompts = [self.build_prompt(s, tokenizer, max_length, query_aware=False) for s in samples]
        context = prompts[0].input_ids[: prompts[0].context_tokens]
        assert all(p.input_ids[: p.context_tokens] == context for p in prompts)
        between, after = self.turn_texts(tokenizer)
        follow_ups = []
        for sample in samples:
            question, prefix = self.question_text(sample.fields["key"])
            turn = between + question + after + prefix
            follow_ups.append(list(tokenizer(turn, add_special_tokens=False)["input_ids"]))
        if self.mode == "multi_turn" and max_length is not None:
            self.check_conversation(samples[0], len(prompts[0].input_ids), [len(f) for f in follow_ups[1:]],
                                    max_length)
        return SharedContext(context, prompts, follow_ups)

    def check_conversation(self, first: Sample, first_prompt: int, turns: list[int], max_length: int) -> None:
        """The multi-turn conversation at its longest (first prompt + follow-up turns + k x tokens to generate;
        an answer's last token is fed with the next turn, so it is counted with its answer) against max_length."""
        to_generate = self.tokens_to_generate()
        answers = (len(turns) + 1) * to_generate
        longest = first_prompt + sum(turns) + answers
        if longest > max_length:
            raise ValueError(
                f"{self.name} context {first.fields['context']}: the multi-turn conversation of {len(turns) + 1} "
                f"questions can reach {longest} tokens (context + first question {first_prompt}, {len(turns)} "
                f"follow-up turns {sum(turns)}, {len(turns) + 1} answers x {to_generate} new tokens {answers}), over "
                f"model.max_length={max_length}; use fewer task.questions, a shorter task.length or a larger "
                "model.max_length")

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"score": string_match_all(postprocess(prediction), list(sample.fields["answers"]))}

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The mean score over the questions (0-1; each context weighs the same), the same per asking rank
        (`by_ask_rank`: 0 = first) and needle depth rank (`by_depth_rank`: 0 = shallowest), counts, k and the mode;
        samples flagged short (as Ruler's) left out."""
        scored = [r for r in rows if not (r.get("info") or {}).get("short", False)]
        values = [float(r["scores"]["score"]) for r in scored]
        return {
            "score": sum(values) / len(values) if values else None,
            "by_ask_rank": mean_by(scored, "question_index"),
            "by_depth_rank": mean_by(scored, "depth_rank"),
            "n": len(values),
            "contexts": len({(r.get("info") or {}).get("context_id") for r in scored}),
            "short": len(rows) - len(scored),
            "questions": self.questions,
            "mode": self.mode,
            "length": self.length,
            "haystack": self.haystack_kind(),
        }

    def haystack_kind(self) -> str:
        if self.haystack != "essay":
            return self.haystack
        self._essay_words()
        return f"essay:{self._essay_kind}"

    def data_sources(self) -> dict[str, str]:
        inputs = {"generator_version": GENERATOR_VERSION, "seed": self.seed, "length": self.length, "questions":
                  self.questions, "num_contexts": self.num_contexts, "haystack": self.haystack, "type_k": self.type_k,
                  "type_v": self.type_v, "ruler_commit": RULER_COMMIT}
        label = f"ruler_shared generator v{GENERATOR_VERSION} (NVIDIA/RULER@{RULER_COMMIT[:10]}, seed {self.seed})"
        digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
        sources = {label: digest, **wonderwords_sources()}
        if self.haystack == "essay":
            self._essay_words()
            sources.update({f"ruler_shared/essay[{self._essay_kind}]/{k}": v for k, v in self._essay_sources.items()})
        return sources


def mean_by(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """The mean score of `rows` per value of their info's `key` (rows without it are left out)."""
    groups: dict[int, list[float]] = {}
    for row in rows:
        value = (row.get("info") or {}).get(key)
        if value is not None:
            groups.setdefault(int(value), []).append(float(row["scores"]["score"]))
    return {str(k): sum(v) / len(v) for k, v in sorted(groups.items())}

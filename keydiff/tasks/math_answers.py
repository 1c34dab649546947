"""Answer extraction and the two Math-500 scores: Exact Match (the last boxed answer after `</think>`,
normalised as the MATH reference scorer does) and Flex Match (Exact, or math-verify's symbolic check).
Pure functions.

Design: docs/design/tasks.md#math-500
"""

from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

THINK_END = "</think>"
_BOX_COMMANDS = ("\\boxed", "\\fbox")


# --- Extraction ---


def answer_region(text: str) -> str:
    """The part of a response that holds the final answer: everything after the last `</think>`."""
    cut = text.rfind(THINK_END)
    return text if cut < 0 else text[cut + len(THINK_END) :]


def last_boxed(text: str) -> str | None:
    """The last box of `text` including its command, e.g. `\\boxed{\\frac{1}{2}}`, or None.

    Only the last `\\boxed` / `\\fbox` counts (as in the MATH reference scorer): cut off (unbalanced braces)
    means no answer. Nested braces come back whole; the brace-less `\\boxed 5` runs to the next `$` or line end."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    body_start = start + len(command)
    if text.startswith(" ", body_start):
        rest = text[body_start + 1 :]
        end = min((i for i in (rest.find("$"), rest.find("\n")) if i >= 0), default=len(rest))
        return command + " " + rest[:end]
    if not text.startswith("{", body_start):
        return None
    depth = 0
    for i in range(body_start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def unbox(boxed: str) -> str:
    """The content of a box returned by `last_boxed` (`\\boxed{x}` -> `x`, `\\boxed x` -> `x`)."""
    for command in _BOX_COMMANDS:
        if boxed.startswith(command + "{") and boxed.endswith("}"):
            return boxed[len(command) + 1 : -1]
        if boxed.startswith(command + " "):
            return boxed[len(command) + 1 :]
    raise ValueError(f"not a \\boxed{{}} or \\fbox{{}} expression: {boxed!r}")


def extract_boxed_answer(response: str) -> str | None:
    """The content of the last box in the answer region of `response`, or None when there is none."""
    boxed = last_boxed(answer_region(response))
    return None if boxed is None else unbox(boxed)


# --- Exact Match: MATH reference normalisation ---


class _NormalisationError(ValueError):
    """The reference normaliser gives up on this string; `is_equiv` then compares raw strings."""


def _drop_units(s: str) -> str:
    # A trailing unit is written "\text{ cm}" (with the space); the reference keeps what precedes it
    # and gives up when there are several.
    parts = s.split("\\text{ ")
    if len(parts) > 2:
        raise _NormalisationError(s)
    return parts[0]


def _brace_sqrt(s: str) -> str:
    # "\sqrt3" -> "\sqrt{3}": only the single following character becomes the argument.
    head, *tails = s.split("\\sqrt")
    out = [head]
    for tail in tails:
        if tail and tail[0] != "{":
            tail = "{" + tail[0] + "}" + tail[1:]
        out.append("\\sqrt" + tail)
    return "".join(out)


def _brace_fracs(s: str) -> str:
    # "\frac12" -> "\frac{1}{2}", "\frac1{b}" -> "\frac{1}{b}"; a too-short tail leaves s unchanged.
    head, *tails = s.split("\\frac")
    out = [head]
    for tail in tails:
        if tail.startswith("{"):
            out.append("\\frac" + tail)
            continue
        if len(tail) < 2:
            return s
        numerator, rest = tail[0], tail[1:]
        if rest[0] == "{":
            out.append("\\frac{" + numerator + "}" + rest)
        else:
            out.append("\\frac{" + numerator + "}{" + rest[0] + "}" + rest[1:])
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    # "3/4" -> "\frac{3}{4}", only when both sides are plain integers written canonically.
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    if s != f"{numerator}/{denominator}":
        return s
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def normalize_answer(s: str) -> str:
    """MATH reference normalisation (Hendrycks `strip_string`), applied to both sides of Exact Match.

    It removes presentation only and never reorders, simplifies or drops `\\text{...}` (so `\\text{(C)}` != `C`).
    Raises `_NormalisationError` where the reference normaliser fails."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _drop_units(s)
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5" -> "5", "k=3" -> "3"
        s = sides[1]
    s = _brace_sqrt(s)
    s = s.replace(" ", "")
    s = _brace_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def is_equiv(prediction: str | None, reference: str | None) -> bool:
    """String equality after `normalize_answer`; raw equality where normalisation fails."""
    if prediction is None or reference is None:
        return prediction is None and reference is None
    try:
        return normalize_answer(prediction) == normalize_answer(reference)
    except _NormalisationError:
        return prediction == reference


def exact_match(response: str, reference: str) -> bool:
    """Exact Match: the last boxed answer of the answer region equals `reference` after normalisation."""
    predicted = extract_boxed_answer(response)
    return predicted is not None and is_equiv(predicted, reference)


# --- Flex Match: math-verify ---


def _timeout() -> int | None:
    # math-verify enforces its timeouts with SIGALRM, which only works in the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_verify_match(response: str, reference: str) -> bool:
    """math-verify equivalence of the answer region of `response` and the reference answer.

    Boxed answers are parsed first; the reference goes first in the asymmetric `verify`, as math-verify
    prescribes. Close boxes read as one set (`\\boxed{1}, then \\boxed{2}` -> {1, 2}) and match neither."""
    timeout = _timeout()
    gold = parse(f"${reference}$", parsing_timeout=timeout)
    predicted = parse(
        answer_region(response),
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=timeout,
    )
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=timeout))


def flex_match(response: str, reference: str) -> bool:
    """Flex Match: Exact Match or math-verify equivalence, so Flex >= Exact for every response."""
    return exact_match(response, reference) or math_verify_match(response, reference)


def score_response(response: str, reference: str) -> dict[str, float]:
    """The per-response scores of Math-500: `exact`, `flex` and `has_answer` (a box was found)."""
    exact = exact_match(response, reference)
    return {
        "exact": float(exact),
        "flex": float(exact or math_verify_match(response, reference)),
        "has_answer": float(extract_boxed_answer(response) is not None),
    }

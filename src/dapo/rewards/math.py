"""Answer scorers: extract and normalise the final answer, compare with the ground truth.

Built-in scorers take ``(response, ground_truth)`` and return +1.0 (correct) or -1.0:

- ``dapo_math``: the DAPO paper's scorer, verl's ``math_dapo.compute_score`` rule for rule
  (:func:`dapo_math_score`). The answer is the last ``Answer: ...`` line in the final 300
  characters of the response; it and the ground truth are normalised by the reference's
  plain text rules and compared as strings, so ``12.``, ``90°``, ``50%`` and ``\\dfrac``
  miss where the ground truth says ``12``, ``90``, ``50`` and ``\\frac``.
- ``dapo_math_lenient``: the same answer format with a forgiving normaliser
  (:func:`normalize_final_answer`: units, degree and percent signs, ``\\dfrac``, a trailing
  period, Unicode minus), for data whose answers the reference's rules miss.
- ``math_verify``: symbolic comparison with the ``math_verify`` library, so ``0.5``
  matches ``\\frac{1}{2}``.
- ``gsm8k``: GSM8K's numeric answers, the last ``#### N`` (else ``\\boxed{N}``, else
  ``Answer: N``) compared as numbers with the ground truth (its ``#### N`` when it is a
  whole GSM8K solution).
- ``code``: runs the response's program against the row's tests in a sandbox
  (:mod:`dapo.rewards.code`).

Without reward functions, a row's scorer is picked by its ``data_source`` as verl's default
scorer picks it (:data:`SOURCE_SCORERS`, then ``code`` for code sources, then
``reward.default_scorer``).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any

from dapo.rewards.code import code_reward

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# dapo_math: the DAPO reference scorer, rule for rule
# ---------------------------------------------------------------------------

_DAPO_WINDOW = 300  # the reference reads the last 300 characters of a response
_DAPO_ANSWER_RE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_DAPO_NO_ANSWER = "[INVALID]"  # what the reference compares when no Answer line is found

# Plain substring rewrites, applied in this order with str.replace: "a " and "an " go
# wherever they occur ("banana 5" -> "banan5"), then every space.
_DAPO_REWRITES: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Plain substrings deleted next, in this order, wherever they occur ("issue" -> "is").
_DAPO_DELETIONS: tuple[str, ...] = (
    *("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units"),
    *("\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm"),
    *("gm", "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples"),
    *("\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}"),
    *("\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots"),
)
# Then these substitutions, in order; none crosses a line break ([^\n], the reference's ".").
_DAPO_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # a line holding two $: the text between its first two, kept as $...$, the rest dropped
    (re.compile(r"[^\n]*?\$([^\n]*?)\$[^\n]*"), r"$\1$"),
    # \text{x}, \textbf{x}, \overline{x} -> x, up to the first }
    (re.compile(r"\\text\{([^\n]*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{([^\n]*?)\}"), r"\1"),
    (re.compile(r"\\overline\{([^\n]*?)\}"), r"\1"),
    # \boxed{x} -> x, up to the last } of the line
    (re.compile(r"\\boxed\{([^\n]*)\}"), r"\1"),
    # frac12 -> frac{1}{2} (also inside dfrac; the first character may be a line break)
    (re.compile(r"frac([^{])([^\n])"), r"frac{\1}{\2}"),
    # sqrt2 -> sqrt{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),
)


def _dapo_normalize(text: str) -> str:
    """The reference's normal form of an answer or a ground truth (see :func:`dapo_math_score`)."""
    text = text.split("=")[-1]
    for before, after in _DAPO_REWRITES:
        text = text.replace(before, after)
    for gone in _DAPO_DELETIONS:
        text = text.replace(gone, "")
    for pattern, replacement in _DAPO_PATTERNS:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    digits = text.replace(",", "")
    if digits.isdigit():  # str.isdigit: Unicode digits and superscripts count too
        text = digits
    return text.strip()


def dapo_math_score(response: str, ground_truth: str) -> float:
    r"""+1.0 when the response's answer equals the ground truth by the DAPO reference's rules,
    else -1.0: verl's ``math_dapo.compute_score`` (default path, no strict box) reproduced,
    quirks included, so that rewards match the paper's.

    1. Only the last 300 characters of ``response`` are read.
    2. The answer is the text of the last match of ``Answer\s*:\s*([^\n]+)``, case ignored
       (``\s*`` may cross a line break: ``Answer:\n42`` gives ``42``); with no match it is
       the string ``[INVALID]``.
    3. The answer and ``str(ground_truth)`` are normalised alike, in this order, every
       replacement a plain substring replacement wherever it occurs:

       - keep the text after the last ``=``;
       - remove ``an `` and ``a `` (``banana 5`` becomes ``banan5``), turn ``.$`` into
         ``$``, remove ``\$``, ``\ `` and every space, turn ``mbox`` into ``text``,
         ``,\text{and}`` and ``\text{and}`` into ``,`` and ``\text{m}`` into ``\text{}``;
       - delete the words square, ways, integers, dollars, mph, inches, hours, km, units,
         sue, points, feet, minutes, digits, cents, degrees, cm, gm, pounds, meters, meals,
         edges, students, childrentickets, multiples (``issue`` becomes ``is``) and the TeX
         pieces ``\ldots``, ``\text{s}``, ``\text{.}``, ``\text{}^2``, ``\text{}^3``,
         ``\text{}``, ``\mathrm{th}``, ``^\circ``, ``^{\circ}``, ``\;``, ``,\!``, ``{,}``,
         ``"``, ``\dots``, and ``\text{s}`` and ``\text{}`` with a line break after the
         ``{`` (the exact order: ``_DAPO_DELETIONS``);
       - on a line holding two ``$``, keep only the text between its first two;
       - unwrap ``\text{x}``, ``\textbf{x}``, ``\overline{x}`` (up to the first ``}``) and
         ``\boxed{x}`` (up to the line's last ``}``);
       - brace shorthand: ``frac12`` becomes ``frac{1}{2}`` (inside ``\dfrac`` too),
         ``sqrt2`` becomes ``sqrt{2}``;
       - drop every ``$``; drop the commas when only digits remain without them
         (``str.isdigit``: ``1,2`` becomes ``12``, ``-1,000`` stays); strip whitespace.

    4. +1.0 when the two normal forms are equal strings, whatever they are (two empty
       forms, or ``[INVALID]`` against a ground truth of ``[INVALID]``, are equal too).

    So ``12.``, ``90°``, ``50%``, ``\dfrac{1}{2}`` and a U+2212 minus miss ``12``, ``90``,
    ``50``, ``\frac{1}{2}`` and ``-``, while ``1,2`` and ``a 12`` match ``12``; use
    ``dapo_math_lenient`` (:func:`dapo_math_lenient_score`) for the forgiving rules.
    """
    found = _DAPO_ANSWER_RE.findall(response[-_DAPO_WINDOW:])
    answer = found[-1] if found else _DAPO_NO_ANSWER
    return 1.0 if _dapo_normalize(answer) == _dapo_normalize(str(ground_truth)) else -1.0


# ---------------------------------------------------------------------------
# dapo_math_lenient: the same answer line, a forgiving normaliser
# ---------------------------------------------------------------------------

_ANSWER_TAIL_CHARS = 300
_ANSWER_RE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)


def extract_answer(response: str) -> str | None:
    """Return the text of the last ``Answer: ...`` line in the last 300 characters, stripped,
    or None: the lenient scorer's reading (the reference takes the same match unstripped,
    and the string ``[INVALID]`` where this gives None)."""
    last = None
    for last in _ANSWER_RE.finditer(response[-_ANSWER_TAIL_CHARS:]):  # noqa: B007
        pass
    return None if last is None else last.group(1).strip()


# \name{...} wrappers whose content is kept.
_WRAPPERS = (
    "boxed",
    "fbox",
    "text",
    "textbf",
    "textit",
    "textrm",
    "textup",
    "textnormal",
    "mbox",
    "mathrm",
    "mathbf",
    "mathit",
    "operatorname",
)
_BOXED_SPACE_RE = re.compile(r"\\boxed\s+")
_WRAPPER_RE = re.compile(r"\\(?:" + "|".join(_WRAPPERS) + r")\s*\{")
# Decorations removed outright (spacing, sizing, degree and percent signs, ellipses).
_DECORATION_RE = re.compile(
    r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\displaystyle|\\q?quad"
    r"|\\[!,;: ]|~"
    r"|\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°"
    r"|\\%|%|\\\$|\$"
    r"|\\l?dots"
)
# Unit and filler words, only as whole words (not inside \commands or other words),
# with an optional square/cube exponent ("cm^2").
_UNIT_WORDS = (
    "degrees",
    "degree",
    "deg",
    "radians",
    "cm",
    "mm",
    "km",
    "meters",
    "meter",
    "metres",
    "metre",
    "inches",
    "inch",
    "feet",
    "foot",
    "ft",
    "yards",
    "yd",
    "miles",
    "mile",
    "mph",
    "units",
    "unit",
    "sq",
    "square",
    "cubic",
    "dollars",
    "dollar",
    "cents",
    "cent",
    "hours",
    "hour",
    "hrs",
    "minutes",
    "minute",
    "mins",
    "seconds",
    "days",
    "weeks",
    "years",
    "grams",
    "gm",
    "kg",
    "pounds",
    "lbs",
    "ounces",
    "oz",
    "liters",
    "litres",
    "ways",
    "points",
    "students",
    "digits",
    "integers",
    "percent",
)
_UNIT_RE = re.compile(
    r"(?<![A-Za-z\\])(?:" + "|".join(_UNIT_WORDS) + r")(?:\^\{?[23]\}?)?(?![A-Za-z])",
    re.IGNORECASE,
)
_FRAC_VARIANT_RE = re.compile(r"\\[dtc]frac(?![A-Za-z])")
_LETTER_RE = re.compile(r"[A-Za-z]")
_FRAC_SQRT_RE = re.compile(r"\\frac|\\sqrt")
_CONTROL_SEQ_RE = re.compile(r"\\(?:[A-Za-z]+|.)", re.DOTALL)
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _frac(_: re.Match[str]) -> str:
    return "\\frac"


def _matching_brace(s: str, open_at: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_at``, or None when unbalanced."""
    depth = 0
    for i in range(open_at, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _unwrap(s: str) -> str:
    """Replace every ``\\boxed{x}``, ``\\text{x}``, ... by ``x`` (nesting-aware)."""
    while (m := _WRAPPER_RE.search(s)) is not None:
        close = _matching_brace(s, m.end() - 1)
        if close is None:  # unbalanced: drop the command and its brace
            s = s[: m.start()] + s[m.end() :]
        else:
            s = s[: m.start()] + s[m.end() : close] + s[close + 1 :]
    return _BOXED_SPACE_RE.sub("", s) if "\\boxed" in s else s


def _read_arg(s: str, i: int) -> tuple[str | None, int]:
    """Read one TeX macro argument at ``i``: a brace group, a control word or one character."""
    if i >= len(s):
        return None, i
    if s[i] == "{":
        close = _matching_brace(s, i)
        if close is None:
            return None, i
        return s[i + 1 : close], close + 1
    if s[i] == "\\":
        m = _CONTROL_SEQ_RE.match(s, i)
        assert m is not None
        return m.group(0), m.end()
    return s[i], i + 1


def _brace_shorthand(s: str) -> str:
    """Brace the arguments of ``\\frac`` and ``\\sqrt``: ``\\frac12`` -> ``\\frac{1}{2}``."""
    out: list[str] = []
    i = 0
    while (m := _FRAC_SQRT_RE.search(s, i)) is not None:
        out.append(s[i : m.end()])
        i = m.end()
        if m.group(0) == "\\sqrt" and s.startswith("[", i) and (end := s.find("]", i)) > 0:
            out.append(s[i : end + 1])  # \sqrt[3]{x}
            i = end + 1
        for _ in range(2 if m.group(0) == "\\frac" else 1):
            arg, i = _read_arg(s, i)
            if arg is None:
                break
            out.append("{" + _brace_shorthand(arg) + "}")
    out.append(s[i:])
    return "".join(out)


def normalize_final_answer(answer: str) -> str:
    """Normalise a final answer for string comparison, leniently (``dapo_math_lenient``).

    Unwraps ``\\boxed{}``/``\\text{}``-like wrappers, keeps the text after the last
    ``=``, strips ``$``, spacing commands, ``\\left``/``\\right``, degree and percent
    signs, unit words and a trailing period, braces ``\\frac12``/``\\sqrt2`` shorthand,
    maps ``\\dfrac``/``\\tfrac`` to ``\\frac``, a U+2212 minus to ``-`` and drops thousands
    separators (a digit group of three after each comma: ``1,2`` stays a list). More
    forgiving than the DAPO reference (:func:`dapo_math_score`).
    """
    return _normalize(str(answer))


@functools.lru_cache(maxsize=8192)
def _normalize(s: str) -> str:
    s = _FRAC_VARIANT_RE.sub(_frac, s.replace("\u2212", "-"))
    s = _unwrap(s)
    s = s.rsplit("=", 1)[-1]
    s = _DECORATION_RE.sub(" ", s)
    if _LETTER_RE.search(s):
        s = _UNIT_RE.sub(" ", s)
    s = "".join(s.split())
    s = _brace_shorthand(s)
    s = s.replace("{,}", ",")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return s.rstrip(".")


def dapo_math_lenient_score(response: str, ground_truth: str) -> float:
    """+1.0 when the ``Answer:`` line (:func:`extract_answer`) and the ground truth agree
    after :func:`normalize_final_answer`, else -1.0; an empty answer never matches."""
    predicted = extract_answer(response)
    if predicted is None:
        return -1.0
    predicted = normalize_final_answer(predicted)
    return 1.0 if predicted and predicted == normalize_final_answer(str(ground_truth)) else -1.0


# ---------------------------------------------------------------------------
# math_verify
# ---------------------------------------------------------------------------


class _DropTimeoutDisabledNotice(logging.Filter):
    """Hide math_verify's 'Timeout is disabled' notice: our worker pool enforces timeouts."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_math_verify_ready = False


def _math_verify() -> Any:
    """Import math_verify lazily (about 1 s) and silence its timeout notice."""
    global _math_verify_ready
    import math_verify

    if not _math_verify_ready:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledNotice())
        _math_verify_ready = True
    return math_verify


def _mv_parse(text: str, *, wrap: bool) -> list[Any]:
    """Parse with math_verify; a bare answer is tried as ``$...$`` LaTeX first."""
    mv = _math_verify()
    if wrap and not any(d in text for d in ("$", "\\boxed", "\\[", "\\(")):
        parsed = mv.parse(f"${text}$", parsing_timeout=None)
        if parsed:
            return parsed
    return mv.parse(text, parsing_timeout=None)


def math_verify_score(response: str, ground_truth: str) -> float:
    """+1.0 when math_verify finds the answer equivalent to the ground truth, else -1.0.

    The candidate is the ``Answer:`` line when there is one, else whatever math_verify
    extracts from the last 300 characters (e.g. a ``\\boxed{}``). math_verify's own
    signal-based timeouts are disabled (they fail outside the main thread); run it
    through :class:`RewardScorer` for a time limit.
    """
    candidate = extract_answer(response)
    if candidate is None:
        target = _mv_parse(response[-_ANSWER_TAIL_CHARS:], wrap=False)
    else:
        target = _mv_parse(candidate, wrap=True)
    gold = _mv_parse(str(ground_truth), wrap=True)
    if not target or not gold:
        return -1.0
    return 1.0 if _math_verify().verify(gold, target, timeout_seconds=None) else -1.0


# ---------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------

_HASHES_RE = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_BOXED_NUMBER_RE = re.compile(r"\\boxed\s*\{\s*\\?\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*\}")


def _last(pattern: re.Pattern[str], text: str) -> str | None:
    found = pattern.findall(text)
    return found[-1] if found else None


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except ValueError:
        return None


def gsm8k_score(response: str, ground_truth: str) -> float:
    """+1.0 when the response's final number (``#### N``, else ``\\boxed{N}``, else
    ``Answer: N``) equals the ground truth's as a number, else -1.0."""
    truth = str(ground_truth)
    gold = _number(_last(_HASHES_RE, truth) or truth)
    answer = _last(_HASHES_RE, response) or _last(_BOXED_NUMBER_RE, response)
    if answer is None:
        answer = extract_answer(response)
    got = _number(answer)
    return 1.0 if gold is not None and got is not None and got == gold else -1.0


def gsm8k_answer(response: str) -> str | None:
    """The number :func:`gsm8k_score` reads (``#### N``, else ``\\boxed{N}``, else
    ``Answer: N``) written canonically (``1,000`` and ``1000.0`` are ``1000``), or None."""
    answer = _last(_HASHES_RE, response) or _last(_BOXED_NUMBER_RE, response)
    got = _number(answer if answer is not None else extract_answer(response))
    if got is None:
        return None
    return str(int(got)) if got.is_integer() else repr(got)


def boxed_or_answer(response: str) -> str | None:
    """The ``Answer:`` line, else the last ``\\boxed{...}``'s content in the last 300
    characters (what :func:`math_verify_score` reads first), or None."""
    answer = extract_answer(response)
    if answer is not None:
        return answer
    tail = response[-_ANSWER_TAIL_CHARS:]
    start = tail.rfind("\\boxed{")
    close = _matching_brace(tail, start + len("\\boxed")) if start >= 0 else None
    return None if close is None else tail[start + len("\\boxed{") : close].strip() or None


SCORERS: dict[str, Callable[..., Any]] = {
    "dapo_math": dapo_math_score,
    "dapo_math_lenient": dapo_math_lenient_score,
    "math_verify": math_verify_score,
    "gsm8k": gsm8k_score,
    "code": code_reward,  # returns a dict; run once per group (dapo.rewards.user.GROUP)
}

# The built-in scorer of the data sources verl's default scorer knows beside DAPO's (its
# GSM8K, MATH and Numina sources; DAPO's own get reward.default_scorer, dapo_math unless
# changed); reward.source_scorers overrides them.
SOURCE_SCORERS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math_verify",
    "DigitalLearningGmbH/MATH-lighteval": "math_verify",
    "HuggingFaceH4/MATH-500": "math_verify",
    "primeintellect": "code",  # DeepCoder's name for PrimeIntellect's coding problems
    **{
        f"numina_{name}": "math_verify"
        for name in (
            "aops_forum",
            "synthetic_math",
            "amc_aime",
            "synthetic_amc",
            "cn_k12",
            "olympiads",
        )
    },
}

# The answer each built-in scorer reads from a response, for maj@k's votes (the code
# scorer reads a program: no vote).
ANSWER_READERS: dict[str, Callable[[str], str | None]] = {
    "dapo_math": extract_answer,
    "dapo_math_lenient": extract_answer,
    "math_verify": boxed_or_answer,
    "gsm8k": gsm8k_answer,
    "code": lambda _response: None,
}

# What each built-in scorer reads and how it compares: the start-up lines name the scorer
# and say this.
SCORER_FORMS = {
    "dapo_math": "the last 'Answer: ...' line, compared as text by the DAPO reference's rules, "
    "verl's math_dapo",
    "dapo_math_lenient": "the last 'Answer: ...' line, compared as text after a lenient "
    "normalisation that forgives units, °, %, \\dfrac and a final period",
    "math_verify": "an 'Answer:' line or a \\boxed{}, compared symbolically by math_verify",
    "gsm8k": "'#### N' (or \\boxed{N}, 'Answer: N'), compared as a number",
    "code": "the last ```python block, run in a sandbox against the row's tests",
}

# Data sources of code tasks (verl's prime_code sources, DeepCoder's, LiveCodeBench,
# PrimeIntellect's coding problems, open-r1's): a name holding "code" or "coding", or a part
# of it one of these, gets the code scorer unless reward.source_scorers says otherwise
# (DeepCoder's "primeintellect" is an entry of SOURCE_SCORERS: PrimeIntellect has math too).
_CODE_SOURCE_RE = re.compile(
    r"code|coding|(^|[/_\-])(apps|taco|codeforces|livecodebench|leetcode)"
    r"([/_\-]|$)",
    re.IGNORECASE,
)


def scorer_for_source(
    data_source: str, mapping: dict[str, str] | None = None, default: str = "dapo_math"
) -> str:
    """Name of the built-in scorer for ``data_source``: its ``mapping`` entry, else the one
    verl's default scorer uses for it (:data:`SOURCE_SCORERS`), else ``code`` for a code
    task's source (``codecontests``, ``deepmind/code_contests``, ``apps``, ``taco``,
    ``livecodebench``, ``primeintellect``...), else ``default``."""
    if mapping and data_source in mapping:
        name = mapping[data_source]
    elif data_source in SOURCE_SCORERS:
        name = SOURCE_SCORERS[data_source]
    else:
        name = "code" if _CODE_SOURCE_RE.search(data_source) else default
    if name not in SCORERS:
        where = (
            f"reward.source_scorers[{data_source!r}]"
            if mapping and data_source in mapping
            else "reward.default_scorer"
        )
        raise ValueError(
            f"unknown reward scorer {name!r} ({where}, data_source {data_source!r}); "
            f"valid names: {', '.join(sorted(SCORERS))}"
        )
    return name

"""Boxed-answer grading with Miles's meaning (``--rm-type math``, and the core of ``deepscaler``/``gemma_math``).

A response is right when the content of its last ``\\boxed{...}`` equals the label under one of two
checks:

1. *string check* (:func:`strict_normalize`): Hendrycks-MATH style clean-up of both sides, then equality.
   It drops ``\\left``/``\\right``, ``\\!``, ``$``, ``\\%``, degree marks, a trailing ``\\text{ unit}``, a short
   ``x =`` prefix and spaces; writes ``\\dfrac``/``\\tfrac`` as ``\\frac``, ``\\frac12`` as ``\\frac{1}{2}``,
   ``\\sqrt2`` as ``\\sqrt{2}``, ``a/b`` (integers) as ``\\frac{a}{b}`` and ``0.5`` as ``\\frac{1}{2}``.
2. *symbolic check* (:func:`symbolic_equal`): a looser normalisation to plain math text (units, ``$``,
   ``%``, ``\\text{}`` removed; ``million`` -> ``*10^6``; LaTeX fractions and roots turned into
   ``(a)/(b)`` and ``sqrt(x)``; lower case), then element by element for tuples and intervals: equal
   strings, or sympy finds ``truth - given`` simplifies to 0. Integers must match exactly, an unreduced
   fraction matches only itself, and expressions with more than two distinct letters or large powers
   are never handed to sympy.

No ``\\boxed`` in the response means 0. The label may itself be boxed (its box content is used).
"""

from __future__ import annotations

import re

from miles.rollout.rm_hub.math_answer import extract_boxed

_MAX_SYMPY_CHARS = 120
_SAFE_EXPR = re.compile(r"[0-9a-z+\-*/^().,_ ]*")


# ---------------------------------------------------------------- 1. string check
def _braced_frac(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{7}`` -> ``\frac{1}{7}``, ``\frac{a}b`` kept."""
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        out.append("\\frac")
        if part.startswith("{"):
            out.append(part)
            continue
        if len(part) < 2:
            return s
        first, second, tail = part[0], part[1], part[2:]
        out.append("{" + first + "}" + (second + tail if second == "{" else "{" + second + "}" + tail))
    return "".join(out)


def _int_slash_to_frac(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _braced_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", s)


def strict_normalize(answer: str | None) -> str | None:
    """The string-check normal form of ``answer`` (None stays None)."""
    if answer is None:
        return None
    s = answer.strip()
    m = re.fullmatch(r"\\text\{(.+?)\}", s)
    if m:
        s = m.group(1).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if s.count("\\text{ ") == 1:  # a unit written on the right: "5 \text{ cm}"
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:
        s = rhs
    s = _braced_sqrt(s).replace(" ", "")
    s = _braced_frac(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _int_slash_to_frac(s)


def strict_equal(given: str, truth: str) -> bool:
    return strict_normalize(truth) == strict_normalize(given)


# ---------------------------------------------------------------- 2. symbolic check
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard")


def _latex_to_text(s: str) -> str:
    """Enough LaTeX for answers: fractions, roots, pi, infinity, products; other commands dropped."""
    s = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    for _ in range(8):  # nested fractions / roots, innermost first
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
        if new == s:
            break
        s = new
    s = re.sub(r"\\sqrt(\w)", r"sqrt(\1)", s)
    for cmd, txt in (("\\pi", "pi"), ("\\infty", "inf"), ("\\cdot", "*"), ("\\times", "*"), ("\\cup", "U")):
        s = s.replace(cmd, txt)
    s = re.sub(r"\\(text|mathrm|mathbf|textbf)\{([^{}]*)\}", r"\2", s)
    return re.sub(r"\\[a-zA-Z]+", "", s).strip()


def _strip_thousands(s: str) -> str:
    while True:
        new = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", s)
        if new == s:
            return s
        s = new


def _float_or_none(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _is_int_str(s: str) -> bool:
    x = _float_or_none(_strip_thousands(s))
    return x is not None and abs(x - round(x)) <= 1e-7


def loose_normalize(expr: str | None) -> str | None:
    """The symbolic-check normal form: plain lower-case math text without units, ``$`` or ``%``."""
    if expr is None:
        return None
    m = re.fullmatch(r"\\text\{(.+?)\}", expr)
    s = m.group(1) if m else expr
    s = s.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    s = s.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in (("million", 6), ("billion", 9), ("trillion", 12)):
        s = s.replace(word, f"*10^{power}")
    for unit in _UNITS:
        s = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", s)
    s = re.sub(r"\^ *\\circ", "", s)
    if s[:1] == "{" and s[-1:] == "}":
        s = s[1:-1]
    s = re.sub(r",\\! *", "", s)
    x = _float_or_none(s)
    if x is not None and abs(x - round(x)) <= 1e-7:
        s = str(int(round(x)))
    if "\\" in s:
        s = _latex_to_text(s)
    s = re.sub(r"- *", "-", s)
    s = re.sub(r"(\d) +(\d)", r"\1+\2", s)  # mixed number "7 3/4" -> 7+3/4
    s = s.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_int_str(s):
        s = str(int(float(_strip_thousands(s))))
    return s


def _sympy_safe(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return (len(letters) <= 2 and len(expr) <= _MAX_SYMPY_CHARS and _SAFE_EXPR.fullmatch(expr) is not None
            and "^{" not in expr and "^(" not in expr and re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr) is None)


def _sympy_zero(truth: str, given: str) -> bool:
    expr = f"({truth})-({given})"
    if not _sympy_safe(expr):
        return False
    import sympy
    from sympy.parsing import sympy_parser

    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        return sympy.simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)) == 0
    except Exception:  # sympy raises many types for text it cannot read: then it is simply not equal
        return False


def _elements(s: str) -> list[str]:
    s = _strip_thousands(s)
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and not any(c in s[1:-1] for c in "()[]"):
        return [e.strip() for e in s[1:-1].split(",")]
    return [s] if s else []


def _is_fraction(s: str) -> bool:
    return re.fullmatch(r"-?[0-9]+.?/0*[1-9][0-9]*.?", s) is not None


def symbolic_equal(given: str, truth: str) -> bool:
    t, g = loose_normalize(truth), loose_normalize(given)
    if t is None or g is None:
        return False
    if t == g:
        return True
    if not g:
        return False
    t_parts, g_parts = _elements(t), _elements(g)
    if len(t_parts) > 1 and (t[0] != g[0] or t[-1] != g[-1]):
        return False  # an interval's brackets must agree
    if len(t_parts) != len(g_parts):
        return False
    for te, ge in zip(t_parts, g_parts):
        if _is_fraction(te) and _is_fraction(ge):
            ok = te == ge
        elif _is_int_str(te) != _is_int_str(ge):
            ok = False
        else:
            ok = _sympy_zero(te, ge)
        if not ok:
            return False
    return True


# ---------------------------------------------------------------- the graders
def grade(given: str, truth: str) -> bool:
    """The two checks above, on already extracted answers."""
    return strict_equal(given, truth) or symbolic_equal(given, truth)


def reference_answer(label: str) -> str | None:
    """The label's answer: its box content when it is boxed, else the label itself."""
    return extract_boxed(label) if "\\boxed" in label else label


def grade_boxed(response: str, label: str) -> bool:
    """``--rm-type math``: the last box of ``response`` against ``label`` (an empty label scores 0)."""
    if not label:
        return False
    truth = reference_answer(label)
    given = extract_boxed(response)
    if truth is None or given is None:
        return False
    return grade(given, truth)

"""Procedural bug injection: small, syntax-preserving edits of Python source, as SWE-smith does.

Each :class:`Mutation` is one minimal textual edit at an AST node's byte offsets: flip a
comparison, swap ``and``/``or``, swap ``+``/``-``, move an integer constant by one, drop a
statement line, or negate an ``if`` condition. Only code inside function bodies is mutated, so
a mutant still imports. Every mutation is checked to parse and to change the AST.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass

__all__ = ["Mutation", "find_mutations", "select_mutations"]

# Comparison flips: each maps the operator to its boundary or logical opposite.
_CMP_FLIP: dict[type[ast.cmpop], tuple[str, str]] = {
    ast.Lt: (r"(?<![<>=!])<(?![<=])", "<="),
    ast.LtE: (r"<=", "<"),
    ast.Gt: (r"(?<![<>=!-])>(?![>=])", ">="),
    ast.GtE: (r">=", ">"),
    ast.Eq: (r"==", "!="),
    ast.NotEq: (r"!=", "=="),
    ast.In: (r"(?<![\w.])in(?!\w)", "not in"),
    ast.NotIn: (r"(?<![\w.])not\s+in(?!\w)", "in"),
    ast.Is: (r"(?<![\w.])is(?!\w)", "is not"),
    ast.IsNot: (r"(?<![\w.])is\s+not(?!\w)", "is"),
}
_BOOL_FLIP = {ast.And: (r"(?<![\w.])and(?!\w)", "or"), ast.Or: (r"(?<![\w.])or(?!\w)", "and")}
_BIN_FLIP = {ast.Add: (r"(?<![+*/])\+(?!=)", "-"), ast.Sub: (r"(?<![-*/])-(?![=>])", "+")}
_AUG_FLIP = {ast.Add: (r"\+=", "-="), ast.Sub: (r"-=", "+=")}


@dataclass(frozen=True)
class Mutation:
    """One candidate bug: replace bytes ``[start, end)`` of a file with ``replacement``.

    Attributes:
        path: File path relative to the repo root (POSIX separators).
        start: Byte offset where the edit starts.
        end: Byte offset where the edit ends (exclusive).
        replacement: The new bytes.
        kind: Mutation operator (``flip_compare``, ``swap_boolop``, ``swap_arith``,
            ``off_by_one``, ``drop_statement``, ``negate_if``).
        function: Qualified name of the enclosing function, e.g. ``LRUCache.popitem``.
        lineno: 1-based line of the edit.
    """

    path: str
    start: int
    end: int
    replacement: bytes
    kind: str
    function: str
    lineno: int

    def apply(self, source: bytes) -> bytes:
        """Return ``source`` with this edit applied."""
        return source[: self.start] + self.replacement + source[self.end :]

    def is_effective(self, source: bytes) -> bool:
        """Tell whether the mutated ``source`` parses and its AST differs from the original's."""
        try:
            return ast.dump(ast.parse(self.apply(source))) != ast.dump(ast.parse(source))
        except (SyntaxError, ValueError):
            return False


class _Offsets:
    """Converts AST (line, UTF-8 byte column) positions to absolute byte offsets."""

    def __init__(self, source: bytes) -> None:
        self.source = source
        self.line_starts = [0]
        for i, b in enumerate(source):
            if b == 0x0A:
                self.line_starts.append(i + 1)

    def at(self, lineno: int, col: int) -> int:
        return self.line_starts[lineno - 1] + col

    def start(self, node: ast.AST) -> int:
        return self.at(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.at(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, source: bytes) -> None:
        self.path = path
        self.off = _Offsets(source)
        self.src = source
        self.scope: list[str] = []
        self.func: str | None = None
        self.found: list[Mutation] = []

    # -- scopes ------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.scope.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        outer, self.func = self.func, ".".join(self.scope)
        self._drop_candidates(node.body)
        for stmt in node.body:  # decorators and defaults are not mutated
            self.visit(stmt)
        self.func = outer
        self.scope.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    # -- helpers -----------------------------------------------------------------------
    def _add(self, start: int, end: int, new: bytes, kind: str, lineno: int) -> None:
        if self.func is not None and start < end:
            self.found.append(Mutation(self.path, start, end, new, kind, self.func, lineno))

    def _token_between(self, a: ast.AST, b: ast.AST, pattern: str, new: str, kind: str) -> None:
        """Replace the single operator token matching ``pattern`` between nodes ``a`` and ``b``."""
        lo, hi = self.off.end(a), self.off.start(b)
        region = self.src[lo:hi].decode("utf-8", "replace")
        if "#" in region:
            return
        hits = list(re.finditer(pattern, region))
        if len(hits) != 1:
            return
        m = hits[0]
        start = lo + len(region[: m.start()].encode())
        end = lo + len(region[: m.end()].encode())
        self._add(start, end, new.encode(), kind, a.end_lineno)  # type: ignore[attr-defined]

    # -- operators ---------------------------------------------------------------------
    def visit_Compare(self, node: ast.Compare) -> None:
        flip = _CMP_FLIP.get(type(node.ops[0]))
        if flip is not None:
            self._token_between(node.left, node.comparators[0], *flip, "flip_compare")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        pattern, new = _BOOL_FLIP[type(node.op)]
        self._token_between(node.values[0], node.values[1], pattern, new, "swap_boolop")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        flip = _BIN_FLIP.get(type(node.op))
        textual = (ast.JoinedStr, ast.List, ast.Tuple, ast.ListComp)
        is_text = any(
            isinstance(side, textual)
            or (isinstance(side, ast.Constant) and isinstance(side.value, (str, bytes)))
            for side in (node.left, node.right)
        )
        if flip is not None and not is_text:
            self._token_between(node.left, node.right, *flip, "swap_arith")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        flip = _AUG_FLIP.get(type(node.op))
        if flip is not None:
            self._token_between(node.target, node.value, *flip, "swap_arith")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if type(value) is int and 0 <= value <= 64:
            text = self.src[self.off.start(node) : self.off.end(node)]
            if text.isdigit():
                new = value + 1 if value <= 1 or (node.lineno + node.col_offset) % 2 else value - 1
                self._add(self.off.start(node), self.off.end(node), str(new).encode(),
                          "off_by_one", node.lineno)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if not isinstance(test, ast.UnaryOp) or not isinstance(test.op, ast.Not):
            start, end = self.off.start(test), self.off.end(test)
            seg = self.src[start:end]
            if isinstance(test, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
                new = b"not " + seg
            else:
                new = b"not (" + seg + b")"
            self._add(start, end, new, "negate_if", node.lineno)
        self.generic_visit(node)

    def _drop_candidates(self, body: list[ast.stmt]) -> None:
        """Whole-line statements that can be removed without emptying their block."""
        if len(body) < 2:
            return
        for stmt in body:
            droppable = isinstance(stmt, (ast.Return, ast.Assign, ast.AugAssign)) or (
                isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            )
            if isinstance(stmt, ast.Return) and stmt.value is None:
                droppable = False
            if droppable:
                start_line = self.off.line_starts[stmt.lineno - 1]
                head = self.src[start_line : self.off.start(stmt)]
                end = self.off.end(stmt)
                nl = self.src.find(b"\n", end)
                tail = self.src[end : nl if nl >= 0 else len(self.src)]
                if head.strip() == b"" and (tail.strip() == b"" or tail.strip().startswith(b"#")):
                    stop = nl + 1 if nl >= 0 else len(self.src)
                    self._add(start_line, stop, b"", "drop_statement", stmt.lineno)

    def generic_visit(self, node: ast.AST) -> None:
        # Statement blocks nested in a function (if/for/while/with/try/except bodies).
        scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if self.func is not None and not isinstance(node, scopes):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    self._drop_candidates(block)
        super().generic_visit(node)


def find_mutations(path: str, source: bytes, *, validate: bool = True) -> list[Mutation]:
    """Return the mutations of one Python file, in source order.

    Args:
        path: The file's path relative to the repo root; recorded in each mutation.
        source: The file's bytes.
        validate: Keep only mutations whose result parses and changes the AST (one parse
            per candidate). Pass False for large files and call
            :meth:`Mutation.is_effective` on the candidates actually used.

    Returns:
        Mutations inside function bodies, one per distinct edit. An unparsable file yields
        an empty list.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    finder = _Finder(path, source)
    finder.visit(tree)
    dump = ast.dump(tree)
    seen: set[tuple[int, int, bytes]] = set()
    out = []
    for m in sorted(finder.found, key=lambda m: (m.start, m.end, m.kind)):
        key = (m.start, m.end, m.replacement)
        if key in seen:
            continue
        seen.add(key)
        if validate:
            try:
                if ast.dump(ast.parse(m.apply(source))) == dump:
                    continue
            except (SyntaxError, ValueError):
                continue
        out.append(m)
    return out


def select_mutations(
    mutations: list[Mutation], rng: random.Random, *, per_function: int = 1
) -> list[Mutation]:
    """Shuffle ``mutations`` with ``rng`` and keep at most ``per_function`` per function.

    Operators are interleaved so that no single kind (e.g. ``off_by_one``, the most common)
    dominates the front of the list.

    Args:
        mutations: Candidates, e.g. from :func:`find_mutations` over several files.
        rng: Seeded random source; the same seed gives the same order.
        per_function: How many mutations one function may contribute, at distinct lines.

    Returns:
        The candidates to try, in order.
    """
    by_kind: dict[str, list[Mutation]] = {}
    for m in mutations:
        by_kind.setdefault(m.kind, []).append(m)
    for kind in sorted(by_kind):
        rng.shuffle(by_kind[kind])
    kinds = sorted(by_kind)
    interleaved: list[Mutation] = []
    while any(by_kind.values()):
        rng.shuffle(kinds)
        for kind in kinds:
            if by_kind[kind]:
                interleaved.append(by_kind[kind].pop())
    taken: dict[tuple[str, str], set[int]] = {}
    out = []
    for m in interleaved:
        lines = taken.setdefault((m.path, m.function), set())
        if len(lines) < per_function and m.lineno not in lines:
            lines.add(m.lineno)
            out.append(m)
    return out

"""Cross-run search of checkpoints with MLflow's search filter grammar (a subset).

    filter   := "" | clause ("and" clause)*
    clause   := metrics.<name> (= | != | > | >= | < | <=) number
              | tags.<key> (= | != | LIKE | ILIKE) string | tags.<key> IN (string, ...)
              | attributes.run | run                      (string operators)
              | attributes.validation_status              (string operators)
              | attributes.step | attributes.report_index (number operators)
    order_by := [<identifier> [ASC | DESC], ...]

Names with dots or dashes are quoted with backticks or double quotes (metrics.`val-loss`),
strings with single or double quotes. ``metric.``, ``tag.``, ``attribute.`` and ``attr.``
are accepted for the prefixes, keywords in any case. As in MLflow there is no ``or``.
A metric compares its merged value (a validated value overrides a reported one); LIKE is
case-sensitive on both databases, ILIKE is not. The filter is parsed by a tokenizer and a
recursive-descent parser (never evaluated) and compiled to one ``select()``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, exists, select
from sqlalchemy.orm import Session, aliased

from validation_service.errors import InvalidInput, InvalidSearch
from validation_service.jobs import ValidationStatus
from validation_service.registry.catalog import checkpoint_record
from validation_service.registry.models import Checkpoint, CheckpointTag, MetricValue, Run
from validation_service.registry.records import CheckpointRecord

NUMBER_OPS = ("=", "!=", ">", ">=", "<", "<=")
STRING_OPS = ("=", "!=", "LIKE", "ILIKE", "IN")
_PREFIXES = {
    "metrics": "metric",
    "metric": "metric",
    "tags": "tag",
    "tag": "tag",
    "attributes": "attribute",
    "attribute": "attribute",
    "attr": "attribute",
}
# attribute name -> (column, whether it is a number)
_ATTRIBUTES = {
    "run": (Run.name, False),
    "validation_status": (Checkpoint.validation_status, False),
    "step": (Checkpoint.step, True),
    "report_index": (Checkpoint.report_index, True),
}
MAX_K = 10_000
# What one search may ask of the database (each term is a join or a subquery): more is a
# 422 naming the cap (README, "Search"), not a query of seconds.
MAX_TERMS = 20
MAX_ORDER_KEYS = 10
MAX_IN_VALUES = 100

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<number>-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>!=|<>|>=|<=|=|>|<)
  | (?P<string>'(?:[^']|'')*'|"(?:[^"]|"")*")
  | (?P<backtick>`[^`]*`)
  | (?P<punct>[.(),])
    """,
    re.VERBOSE,
)


@dataclasses.dataclass(frozen=True)
class Token:
    kind: str  # number, word, op, string, backtick, punct, end
    text: str
    position: int

    @property
    def value(self) -> Any:
        if self.kind == "number":
            return float(self.text)
        if self.kind in ("string", "backtick"):
            quote = self.text[0]
            return self.text[1:-1].replace(quote * 2, quote)
        return self.text


@dataclasses.dataclass(frozen=True)
class Identifier:
    kind: str  # metric, tag, attribute
    name: str
    position: int


@dataclasses.dataclass(frozen=True)
class Clause:
    target: Identifier
    op: str  # one of NUMBER_OPS or STRING_OPS, upper case
    value: float | str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class OrderKey:
    target: Identifier
    descending: bool


def tokenize(text: str) -> list[Token]:
    tokens = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            if text[position] in "'\"`":
                raise InvalidSearch(text, position, "a quote that is closed")
            raise InvalidSearch(
                text,
                position,
                f"a name, a number, a quoted string or an operator, found {text[position]!r} "
                "(quote names with dots or dashes in backticks: metrics.`val-loss`)",
            )
        kind = match.lastgroup
        if kind != "space":
            tokens.append(Token(kind, match.group(), position))
        position = match.end()
    tokens.append(Token("end", "", len(text)))
    return tokens


class _Parser:
    """Recursive descent over the tokens of one filter or order_by item."""

    def __init__(self, text: str):
        self.text = text
        self.tokens = tokenize(text)
        self.index = 0

    @property
    def current(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.current
        self.index += 1
        return token

    def fail(self, expected: str, token: Token | None = None) -> InvalidSearch:
        token = token or self.current
        found = "the end" if token.kind == "end" else repr(token.text)
        return InvalidSearch(self.text, token.position, f"{expected}, found {found}")

    def is_word(self, *words: str) -> bool:
        return self.current.kind == "word" and self.current.text.lower() in words

    def expect_end(self, expected: str) -> None:
        if self.current.kind != "end":
            raise self.fail(expected)

    # filter := "" | clause ("and" clause)*
    def parse_filter(self) -> list[Clause]:
        if self.current.kind == "end":
            return []
        clauses = [self.parse_clause()]
        while self.is_word("and"):
            if len(clauses) == MAX_TERMS:
                raise InvalidInput(
                    f"A search filter may have at most {MAX_TERMS} terms joined by 'and'; "
                    "narrow it to fewer terms, or run several searches."
                )
            self.advance()
            clauses.append(self.parse_clause())
        if self.is_word("or"):
            raise self.fail("'and' (the grammar has no 'or', as in MLflow: run two searches)")
        self.expect_end("'and' or the end of the filter")
        return clauses

    def parse_clause(self) -> Clause:
        target = self.parse_identifier()
        numeric = target.kind == "metric" or (
            target.kind == "attribute" and _ATTRIBUTES[target.name][1]
        )
        allowed = NUMBER_OPS if numeric else STRING_OPS
        op_token = self.current
        if op_token.kind == "op":
            op = "!=" if op_token.text == "<>" else op_token.text
        elif self.is_word("like", "ilike", "in"):
            op = op_token.text.upper()
        else:
            raise self.fail(f"an operator ({' '.join(allowed)})")
        if op not in allowed:
            raise self.fail(f"an operator for {_describe(target)} ({' '.join(allowed)})")
        self.advance()
        if op == "IN":
            return Clause(target, op, self.parse_string_list())
        token = self.advance()
        if numeric and token.kind != "number":
            raise self.fail(f"a number to compare {_describe(target)} with", token)
        if not numeric and token.kind != "string":
            raise self.fail(f"a quoted string to compare {_describe(target)} with", token)
        value = token.value
        if target.kind == "attribute" and target.name == "validation_status" and op != "LIKE":
            _check_status(self, value, token)
        return Clause(target, op, value)

    def parse_string_list(self) -> tuple[str, ...]:
        if not (self.current.kind == "punct" and self.current.text == "("):
            raise self.fail("'(' to start the list of IN")
        self.advance()
        values = []
        while True:
            token = self.advance()
            if token.kind != "string":
                raise self.fail("a quoted string in the list of IN", token)
            values.append(token.value)
            if len(values) > MAX_IN_VALUES:
                raise InvalidInput(
                    f"An IN list may hold at most {MAX_IN_VALUES} strings; use LIKE with a "
                    "pattern, or run several searches."
                )
            separator = self.advance()
            if separator.kind == "punct" and separator.text == ")":
                return tuple(values)
            if not (separator.kind == "punct" and separator.text == ","):
                raise self.fail("',' or ')' in the list of IN", separator)

    # identifier := prefix "." name | "run"
    def parse_identifier(self) -> Identifier:
        token = self.current
        if token.kind != "word":
            raise self.fail("metrics.<name>, tags.<key>, attributes.<name> or run")
        word = token.text.lower()
        self.advance()
        if word in _ATTRIBUTES and not (self.current.kind == "punct" and self.current.text == "."):
            return Identifier("attribute", word, token.position)
        kind = _PREFIXES.get(word)
        if kind is None:
            raise self.fail("metrics.<name>, tags.<key>, attributes.<name> or run", token)
        if not (self.current.kind == "punct" and self.current.text == "."):
            raise self.fail(f"'.' and a name after {token.text!r}")
        self.advance()
        name_token = self.advance()
        quoted = name_token.kind == "backtick" or (
            name_token.kind == "string" and name_token.text.startswith('"')
        )
        if name_token.kind != "word" and not quoted:
            raise self.fail(
                "a name (quote it with backticks if it has dots or dashes: metrics.`a-b`)",
                name_token,
            )
        name = name_token.value
        if not name:
            raise self.fail("a name that is not empty", name_token)
        if kind == "attribute":
            name = name.lower()
            if name not in _ATTRIBUTES:
                raise self.fail(f"an attribute ({', '.join(sorted(_ATTRIBUTES))})", name_token)
        return Identifier(kind, name, token.position)

    # order key := identifier [ASC | DESC]
    def parse_order_key(self) -> OrderKey:
        target = self.parse_identifier()
        descending = False
        if self.is_word("asc", "desc"):
            descending = self.advance().text.lower() == "desc"
        self.expect_end("ASC, DESC or the end of the order_by item")
        return OrderKey(target, descending)


def _describe(target: Identifier) -> str:
    prefix = {"metric": "metrics", "tag": "tags", "attribute": "attributes"}[target.kind]
    return f"{prefix}.{target.name}"


def _check_status(parser: _Parser, value: str | tuple, token: Token) -> None:
    if token.kind == "string" and value.upper() not in ValidationStatus.__members__:
        known = ", ".join(ValidationStatus.__members__)
        raise parser.fail(f"a validation status ({known})", token)


def parse_filter(text: str) -> list[Clause]:
    if not isinstance(text, str):
        raise InvalidInput(f"filter must be a str, got {type(text).__name__}")
    return _Parser(text).parse_filter()


def parse_order_by(items: Sequence[str] | None) -> list[OrderKey]:
    if items is None:
        return []
    if isinstance(items, str) or not all(isinstance(item, str) for item in items):
        raise InvalidInput(
            f"order_by must be a list of str such as ['metrics.accuracy DESC'], got {items!r}"
        )
    if len(items) > MAX_ORDER_KEYS:
        raise InvalidInput(
            f"order_by may have at most {MAX_ORDER_KEYS} keys, got {len(items)}; the first "
            "few decide the order in practice."
        )
    return [_Parser(item).parse_order_key() for item in items]


def check_k(k: Any) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise InvalidInput(f"k must be an int from 1 to {MAX_K}, got {k!r}")
    return k


# ------------------------------------------------------------------ compile
def _like(column, pattern: str, dialect: str):
    """Case-sensitive LIKE: SQLite's LIKE ignores case, so it gets GLOB instead."""
    if dialect != "sqlite":
        return column.like(pattern)
    glob = []
    escaped = False
    for char in pattern:
        if escaped:
            glob.append(f"[{char}]" if char in "*?[" else char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "%":
            glob.append("*")
        elif char == "_":
            glob.append("?")
        elif char in "*?[":
            glob.append(f"[{char}]")
        else:
            glob.append(char)
    return column.op("GLOB")("".join(glob))


def _compare(column, op: str, value: Any, dialect: str):
    if op == "=":
        return column == value
    if op == "!=":
        return column != value
    if op == ">":
        return column > value
    if op == ">=":
        return column >= value
    if op == "<":
        return column < value
    if op == "<=":
        return column <= value
    if op == "LIKE":
        return _like(column, value, dialect)
    if op == "ILIKE":
        return column.ilike(value)
    if op == "IN":
        return column.in_(list(value))
    raise AssertionError(op)


def _condition(clause: Clause, dialect: str):
    target = clause.target
    if target.kind == "metric":
        return exists().where(
            MetricValue.checkpoint_id == Checkpoint.id,
            MetricValue.name == target.name,
            MetricValue.effective == True,  # noqa: E712 - the merged view's value
            _compare(MetricValue.value, clause.op, clause.value, dialect),
        )
    if target.kind == "tag":
        return exists().where(
            CheckpointTag.checkpoint_id == Checkpoint.id,
            CheckpointTag.key == target.name,
            _compare(CheckpointTag.value, clause.op, clause.value, dialect),
        )
    column, numeric = _ATTRIBUTES[target.name]
    value = clause.value
    if target.name == "validation_status" and clause.op in ("=", "!=", "IN"):
        value = tuple(v.upper() for v in value) if clause.op == "IN" else value.upper()
    if target.name == "step" and clause.op == "!=":
        # A checkpoint without a step has none to differ: it does not match, as in MLflow.
        return and_(column.is_not(None), column != value)
    return _compare(column, clause.op, value, dialect)


def search_query(
    namespace: str,
    clauses: list[Clause],
    order: list[OrderKey],
    k: int,
    dialect: str,
):
    """One select() of (checkpoint columns, run name): matches of every clause, not
    deleted, in ``order`` (missing values last), then in report order."""
    query = (
        select(Checkpoint, Run.name.label("run_name"))
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.namespace == namespace, Checkpoint.deleted_at.is_(None))
        .where(*[_condition(clause, dialect) for clause in clauses])
    )
    ordering = []
    for number, key in enumerate(order):
        if key.target.kind == "metric":
            value = aliased(MetricValue, name=f"order_metric_{number}")
            query = query.outerjoin(
                value,
                and_(
                    value.checkpoint_id == Checkpoint.id,
                    value.name == key.target.name,
                    value.effective == True,  # noqa: E712
                ),
            )
            column = value.value
        elif key.target.kind == "tag":
            tag = aliased(CheckpointTag, name=f"order_tag_{number}")
            query = query.outerjoin(
                tag, and_(tag.checkpoint_id == Checkpoint.id, tag.key == key.target.name)
            )
            column = tag.value
        else:
            column = _ATTRIBUTES[key.target.name][0]
        # Missing values last in both directions ("IS NULL" sorts false first), portably.
        ordering.append(column.is_(None))
        ordering.append(column.desc() if key.descending else column.asc())
    ordering.extend([Checkpoint.run_id.asc(), Checkpoint.report_index.asc()])
    return query.order_by(*ordering).limit(k)


def search(
    session: Session,
    namespace: str,
    filter: str,
    order_by: Sequence[str] | None,
    k: int,
) -> list[CheckpointRecord]:
    """The matching checkpoints of the namespace's runs (every attempt), not deleted.

    Raises InvalidSearch / InvalidInput, before any query, for a filter, order_by or k
    that does not parse.
    """
    clauses = parse_filter(filter)
    order = parse_order_by(order_by)
    check_k(k)
    query = search_query(namespace, clauses, order, k, session.get_bind().dialect.name)
    return [checkpoint_record(c, run_name) for c, run_name in session.execute(query)]

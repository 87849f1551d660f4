"""The SQL shapes the bulk writers share (the aggregation pass and the scheduling cycle).

PostgreSQL gets set-based statements: arrays passed as one text literal and unnested in SQL,
``COPY`` for inserts. SQLite (the embedded default, small fleets) gets plain ``executemany``.
Callers branch on ``is_postgresql()`` only where the SQL itself differs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import connection, connections, models, router
from django.db.models import Model, Q
from django.db.models.expressions import RawSQL

NULL = "\\N"  # NULL in COPY's text format
TRUE = "t"


def is_postgresql() -> bool:
    return connection.vendor == "postgresql"


def columns_of(model: type[Model], alias: str) -> str:
    """Every concrete column of ``model``, qualified by ``alias``, in field order: a written-out
    query's select list that ``from_row`` reads back."""
    return ", ".join(f'{alias}."{field.column}"' for field in model._meta.concrete_fields)


def from_row(model: type[Model], values: Sequence[Any]) -> Model:
    """The instance a row of ``columns_of(model, …)`` holds, each value through its field's
    ``from_db_value`` as the ORM's own reads do (a JSON column comes back from the driver as
    text)."""
    fields = model._meta.concrete_fields
    values = [
        field.from_db_value(value, None, connection) if hasattr(field, "from_db_value") else value
        for field, value in zip(fields, values, strict=True)
    ]
    return model.from_db(connection.alias, [field.attname for field in fields], values)


def pg_array(values: Iterable[Any]) -> str:
    """A PostgreSQL array literal of numbers, passed as one text parameter and cast in SQL
    (``%s::bigint[]``): far cheaper than adapting tens of thousands of values one by one. None
    is SQL's NULL."""
    return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"


def ids_among(field: str, ids: Iterable[int]) -> Q:
    """A filter ``field IN ids`` for a long list of integer ids. On PostgreSQL the ids go as one
    array parameter, unnested in a subquery (``field IN (SELECT unnest(…))``): an IN list binds
    and plans every id on its own, which for 10,000 ids costs 50–100 ms against 8–14. Django
    still names the column, so the filter holds in joins and subqueries too."""
    if not is_postgresql():
        return Q(**{f"{field}__in": list(ids)})
    return Q(**{f"{field}__in": RawSQL("SELECT unnest(%s::bigint[])", [pg_array(ids)])})


def pg_text_array(values: Iterable[str]) -> str:
    """A PostgreSQL array literal of strings, quoted and escaped (``%s::text[]``)."""
    return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"


def copy_escape(text: str) -> str:
    """A string made safe for one field of COPY's text format."""
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def bulk_insert(table: str, columns: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> None:
    """Insert rows written in COPY's text form (``NULL`` for null, ``TRUE`` for true, UUIDs
    with dashes): ``COPY`` on PostgreSQL, an order of magnitude cheaper than INSERT;
    ``executemany`` on SQLite, with the values turned back."""
    if not rows:
        return
    with connection.cursor() as cursor:
        if is_postgresql():
            # psycopg's own cursor: its errors become Django's (IntegrityError, OperationalError)
            with (
                connection.wrap_database_errors,
                cursor.cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy,
            ):
                copy.write("".join("\t".join(map(str, row)) + "\n" for row in rows))
        else:
            placeholders = ", ".join(["%s"] * len(columns))
            cursor.executemany(
                f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({placeholders})",
                [tuple(_sqlite_value(v) for v in row) for row in rows],
            )


COPY_FROM_ROWS = 32  # below this a plain INSERT … RETURNING (one round trip, against two) wins


def copy_create(model: type[Model], objs: list[Model]) -> list[Model]:
    """``model.objects.bulk_create(objs)`` for new rows whose key comes from the table's sequence,
    through ``COPY`` on PostgreSQL when there are many: the keys are taken from the sequence
    first (one statement; in the order of ``objs``, ascending, as ``bulk_create`` hands them
    out), then every row is streamed with its values dumped by the driver. Django's
    ``bulk_create`` binds each value into a parameter array in Python, which for a 500-job batch
    cost more than the rest of the insert. Values are prepared as ``bulk_create`` prepares them
    (``pre_save`` fills ``auto_now_add``, ``get_db_prep_save`` JSON, converts types), except a
    value that already is what its column holds (``_PLAIN``: a ``str`` for text, an ``int`` for
    an integer or an integer key, a ``bool``, a ``float``, or None), which Django would pass on
    unchanged. A constraint violation raises Django's ``IntegrityError``. Few rows, SQLite, and
    models this does not cover (a key not from a sequence, inherited tables, generated columns)
    go through ``bulk_create``; values must be data, not SQL expressions."""
    meta = model._meta
    fields = list(meta.concrete_fields)
    if (
        not objs
        or not is_postgresql()
        or not isinstance(meta.pk, _KEYS)
        or meta.parents
        or any(getattr(f, "generated", False) for f in fields)
    ):
        return model.objects.bulk_create(objs)
    quote, db = connection.ops.quote_name, connections[connection.alias]  # not the proxy, per value
    if len(objs) < COPY_FROM_ROWS:
        return _insert_returning(model, objs, db)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT nextval(pg_get_serial_sequence(%s, %s)) FROM generate_series(1, %s)",
            [meta.db_table, meta.pk.column, len(objs)],
        )
        keys = sorted(key for (key,) in cursor.fetchall())
        for obj, key in zip(objs, keys, strict=True):
            obj._prepare_related_fields_for_save(operation_name="bulk_create")
            setattr(obj, meta.pk.attname, key)
        columns = ", ".join(quote(f.column) for f in fields)
        with (
            connection.wrap_database_errors,
            cursor.cursor.copy(f"COPY {quote(meta.db_table)} ({columns}) FROM STDIN") as copy,
        ):
            plain = _plain_plan(fields)
            for obj in objs:
                copy.write_row(_row_values(obj, plain, db))
    alias = connection.alias  # the proxy's attribute, read once: per object it was 2 % of a batch
    for obj in objs:
        obj._state.adding, obj._state.db = False, alias
    return objs


def _insert_returning(model: type[Model], objs: list[Model], db: Any) -> list[Model]:
    """Few rows: one ``INSERT … RETURNING`` of the key, written out with the values prepared as
    for ``COPY`` (Django's insert compiler cost a one-job submission more than the statement)."""
    meta, quote = model._meta, connection.ops.quote_name
    fields = [f for f in meta.concrete_fields if f is not meta.pk]
    plain = _plain_plan(fields)
    params: list[Any] = []
    for obj in objs:
        obj._prepare_related_fields_for_save(operation_name="bulk_create")
        params += _row_values(obj, plain, db)
    row = f"({', '.join(['%s'] * len(fields))})"
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote(meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "
            f"VALUES {', '.join([row] * len(objs))} RETURNING {quote(meta.pk.column)}",
            params,
        )
        keys = [key for (key,) in cursor.fetchall()]
    alias = connection.alias
    for obj, key in zip(objs, keys, strict=True):
        setattr(obj, meta.pk.attname, key)
        obj._state.adding, obj._state.db = False, alias
    return objs


def new_instances(model: type[Model], rows: Iterable[Mapping[str, Any]]) -> list[Model]:
    """``[model(**row) for row in rows]``, made positionally as Django makes the instances it
    reads (``Model(*values)``): a third of the time of keyword arguments, which a 500-job batch
    paid twice (its jobs and their events). A row names fields by attribute (``queue_id``) or a
    relation by name with its object (``queue``: its key is taken and the object cached, and the
    instance's database set, as the keyword would). Fields a row leaves out get their defaults, a
    callable one called per row. Values are not checked: rows come from code, not clients."""
    relations, constant, by_attname = _instance_plan(model)
    made = []
    for row in rows:
        related = [(relations[name], value) for name, value in row.items() if name in relations]
        given = dict(row)
        for field, value in related:
            del given[field.name]
            given[field.attname] = None if value is None else getattr(value, field.target_field.attname)
        unknown = given.keys() - by_attname.keys()
        if unknown:
            raise TypeError(f"{model.__name__} has no field {sorted(unknown)[0]!r}")
        obj = model(
            *[
                given[name]
                if name in given
                else constant[name]
                if name in constant
                else by_attname[name].get_default()
                for name in by_attname
            ]
        )
        for field, value in related:
            field.set_cached_value(obj, value)
            if value is not None and obj._state.db is None:  # as the relation's descriptor does
                obj._state.db = router.db_for_write(model, instance=value)
        made.append(obj)
    return made


@functools.cache
def _instance_plan(model: type[Model]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """For ``new_instances``, once per model: its relations by name, the defaults that are not
    called per row (Django hands out the same object for each), and its fields by attribute."""
    fields = list(model._meta.concrete_fields)
    relations = {f.name: f for f in fields if f.is_relation}
    called = {f.attname for f in fields if f.has_default() and callable(f.default)}
    constant = {f.attname: f.get_default() for f in fields if f.attname not in called}
    return relations, constant, {f.attname: f for f in fields}


def _plain_plan(fields: Sequence[models.Field]) -> list[tuple[models.Field, str, set[type]]]:
    """Per field, what ``_row_values`` needs: the field, its attribute, the types it passes on
    unprepared (a set ``_prepared`` may add to, for the rest of one write)."""
    return [(f, f.attname, set(_plain_types(f))) for f in fields]


def _row_values(obj: Model, plain: list[tuple[models.Field, str, set[type]]], db: Any) -> list[Any]:
    """``obj``'s values for the fields of ``plain``, as ``bulk_create`` would write them: a value
    already of a type its column holds as it is, else prepared by its field."""
    values = obj.__dict__
    return [
        value
        if types and ((value := values[attname]) is None or type(value) in types)
        else _prepared(f, obj, types, db)
        for f, attname, types in plain
    ]


def _prepared(field: models.Field, obj: Model, types: set[type], db: Any) -> Any:
    """``field``'s value of ``obj`` prepared as ``bulk_create`` prepares it. A text column's value
    of a subclass of ``str`` (a choices enum: ``JobState.PENDING``) comes back as it was: its
    class joins ``types`` and is streamed as it is for the rest of the rows."""
    value = field.get_db_prep_save(field.pre_save(obj, True), db)
    if str in types and isinstance(value, str) and value is obj.__dict__[field.attname]:
        types.add(type(value))
    return value


# Per field class (exactly these, not subclasses, which may convert), the Python types whose
# values Django's preparation passes on unchanged: those go to COPY's stream as they are.
_PLAIN: dict[type, tuple[type, ...]] = {
    models.CharField: (str,),
    models.TextField: (str,),
    models.IntegerField: (int,),
    models.BigIntegerField: (int,),
    models.SmallIntegerField: (int,),
    models.PositiveIntegerField: (int,),
    models.PositiveBigIntegerField: (int,),
    models.PositiveSmallIntegerField: (int,),
    models.BooleanField: (bool,),
    models.FloatField: (float,),
}
_KEYS = models.AutoField | models.BigAutoField | models.SmallAutoField


# Field classes whose preparation turns None into None (NULL), whatever it makes of a value.
_NULL_AS_IS = (models.DateTimeField, models.DateField, models.UUIDField)


def _plain_types(field: models.Field) -> tuple[type, ...]:
    """What ``copy_create`` may stream unprepared for ``field`` (nothing: always prepared). On
    these fields None is streamed unprepared too: Django would write it as NULL."""
    if isinstance(field, _KEYS):  # the table's own key, taken from its sequence as an int
        return (int,)
    if field.many_to_one:  # a key: plain when what it points at is an integer key; else only None
        return (int,) if isinstance(field.target_field, _KEYS) else (type(None),)
    if field.auto_created or getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False):
        return ()
    if type(field) in _NULL_AS_IS:
        return (type(None),)
    return _PLAIN.get(type(field), ())


def _sqlite_value(value: Any) -> Any:
    if value == NULL:
        return None
    if value == TRUE:
        return True
    if isinstance(value, str) and len(value) == 36 and value.count("-") == 4:
        return value.replace("-", "")  # Django stores UUIDs as 32 hex digits on SQLite
    if isinstance(value, str) and "\\" in value:
        return _unescape(value)
    return value


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            out.append({"t": "\t", "n": "\n", "r": "\r"}.get(text[i + 1], text[i + 1]))
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)

"""The Python side's picture of the compiled core's structs matches the C header, field by field."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from fireflyer.hfreduce.engine import node_stage
from fireflyer.hfreduce.engine.node_stage import COMM_FIELDS, JOB_FIELDS, comm_spec, job_spec

HEADER = Path(node_stage.__file__).parents[1] / "_core" / "node.h"


def c_fields(struct: str) -> list[str]:
    """The field names of ``typedef struct { int64_t a; ... } STRUCT;`` in node.h, in order (int64 only)."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    body = re.search(r"typedef struct \{([^}]*)\}\s*" + struct + r"\s*;", text)
    assert body, f"{struct} not found in {HEADER}"
    fields = [f.strip() for f in body.group(1).split(";") if f.strip()]
    assert all(f.startswith("int64_t ") for f in fields), f"{struct} has a field that is not int64_t: {fields}"
    return [f.split()[-1] for f in fields]


def test_hfr_job_is_packed_in_the_headers_field_order():
    assert list(JOB_FIELDS) == c_fields("hfr_job")
    params = [p.name for p in inspect.signature(job_spec).parameters.values()]
    assert params == list(JOB_FIELDS), "job_spec's parameters follow hfr_job"


def test_each_field_lands_in_its_own_slot():
    values = {name: 1000 + i for i, name in enumerate(JOB_FIELDS)}
    packed = job_spec(**values)
    assert len(packed) == 8 * len(JOB_FIELDS)
    for i, name in enumerate(JOB_FIELDS):
        assert int.from_bytes(packed[8 * i:8 * i + 8], "little", signed=True) == values[name], name


def test_hfr_comm_is_packed_by_name_in_the_headers_field_order():
    assert list(COMM_FIELDS) == c_fields("hfr_comm")
    values = {name: 2000 + i for i, name in enumerate(COMM_FIELDS)}
    packed = comm_spec(**dict(reversed(values.items())))  # the caller's order does not matter
    assert len(packed) == 8 * len(COMM_FIELDS)
    for i, name in enumerate(COMM_FIELDS):
        assert int.from_bytes(packed[8 * i:8 * i + 8], "little", signed=True) == values[name], name
    missing = dict(values)
    del missing["spin"]
    with pytest.raises(TypeError, match="hfr_comm needs exactly"):
        comm_spec(**missing)
    with pytest.raises(TypeError, match="hfr_comm needs exactly"):
        comm_spec(**values, stray=1)

"""Compiled-program accounting on 8 simulated CPU devices, mesh (data=2, pipe=1, tensor=4).

What XLA's CPU backend emits here (jax 0.10.2, 0.11.2, 0.12): every collective is synchronous (`all-reduce(`, no
`-start`/`-done`); psum_scatter stays a real `reduce-scatter`, all_gather an `all-gather`, ppermute a
`collective-permute`, all_to_all a tuple-shaped `all-to-all` of t slices; replica groups are explicit lists on 0.10
and `mesh[...] {'tensor'}` on 0.11+; every scan's while loop carries `known_trip_count`. The async, iota and
inline-operand forms other backends and versions print are checked on hand-written HLO at the end.
"""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import hlo

B, T, D = 3, 5, 7  # primes ease shape tracing
F32 = 4


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 1, 4), ("data", "pipe", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _compile(f, *args):
    return jax.jit(f).lower(*args).compile()


def test_dot_flops_counts_every_scan_step():
    def f(x, ws):  # x: (B, D), ws: (16, D, D)
        return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]

    compiled = _compile(f, jnp.ones((B, D)), jnp.ones((16, D, D)))
    per_matmul = 2 * B * D * D
    assert hlo.dot_flops(compiled) == 16 * per_matmul
    assert list(hlo.loop_trip_counts(compiled).values()) == [16]
    # The trap: XLA's cost analysis counts the loop body once, so it sees about one matmul of the sixteen.
    xla_flops = hlo.cost(compiled)["flops"]
    assert 0 < xla_flops < hlo.dot_flops(compiled)


def test_nested_scans_multiply_and_outside_matmul_counts_once():
    def f(x, ws):  # ws: (3, 5, D, D); one more matmul after the loops
        def outer(h, ws_inner):
            return jax.lax.scan(lambda h, w: (h @ w, None), h, ws_inner)[0], None

        return jax.lax.scan(outer, x, ws)[0] @ ws[0, 0]

    compiled = _compile(f, jnp.ones((B, D)), jnp.ones((3, 5, D, D)))
    assert hlo.dot_flops(compiled) == (3 * 5 + 1) * 2 * B * D * D
    assert sorted(hlo.loop_trip_counts(compiled).values()) == [3, 5]


def test_psum_in_scan_counts_each_step(mesh):
    L = 5

    def f(xs):  # xs: (L, B, T, D), replicated
        def inner(xs):
            return jax.lax.scan(lambda c, x: (c + jax.lax.psum(x, "tensor"), None), jnp.zeros((B, T, D)), xs)[0]

        # check_vma=False: a fixture for the HLO parser. Under check_vma a psum of a replicated (invariant) value is
        # a multiply by the group size, not an all-reduce, and the collective this test counts would not exist.
        return jax.shard_map(inner, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(xs)

    cols = hlo.collectives(_compile(f, jnp.ones((L, B, T, D))), mesh)
    assert len(cols) == 1
    c = cols[0]
    n = B * T * D * F32
    assert (c.kind, c.axes, c.group_size, c.shape, c.bytes, c.count) == ("all-reduce", ("tensor",), 4, "f32[3,5,7]",
                                                                         n, L)
    assert c.sent_bytes == pytest.approx(2 * 3 / 4 * n)
    summary = hlo.collective_summary(cols)
    assert summary == {"all-reduce@tensor": {"count": L, "sent_bytes": pytest.approx(L * 2 * 3 / 4 * n),
                                             "bytes": L * n}}
    json.dumps(summary)


def test_collective_kinds_axes_and_bytes(mesh):
    local = (B, 8, D)  # per-device block of a (2B, 8, 4D) array sharded P("data", None, "tensor")
    n = B * 8 * D * F32

    def f(a):
        def inner(a):
            return (jax.lax.all_gather(a, "tensor", axis=1, tiled=True),
                    jax.lax.psum_scatter(a, "tensor", scatter_dimension=1, tiled=True),
                    jax.lax.psum(a, "data"),
                    jax.lax.psum(a, ("data", "tensor")),
                    jax.lax.ppermute(a, "tensor", [(i, (i + 1) % 4) for i in range(4)]),
                    jax.lax.all_to_all(a, "tensor", 1, 2, tiled=True))

        # check_vma=False: a parser fixture whose out_specs do not describe what each collective returns (the
        # all-gather and psum outputs are replicated over axes the spec leaves split).
        return jax.shard_map(inner, mesh=mesh, in_specs=P("data", None, "tensor"), out_specs=(P("data"),) * 6,
                             check_vma=False)(a)

    cols = hlo.collectives(_compile(f, jnp.ones((2 * B, 8, 4 * D))), mesh)
    got = {hlo.summary_key(c.kind, c.axes): (c.group_size, c.bytes, c.sent_bytes, c.count) for c in cols}
    assert got == {
        "all-gather@tensor": (4, 4 * n, 3 / 4 * 4 * n, 1),  # N = the gathered output f32[B, 32, D]
        "reduce-scatter@tensor": (4, n, 3 / 4 * n, 1),  # N = the input
        "all-reduce@data": (2, n, 2 * 1 / 2 * n, 1),
        "all-reduce@data,tensor": (8, n, 2 * 7 / 8 * n, 1),
        "collective-permute@tensor": (4, n, n, 1),
        "all-to-all@tensor": (4, n, 3 / 4 * n, 1),
    }
    shapes = {c.kind: c.shape for c in cols}
    assert shapes["all-gather"] == f"f32[{B},32,{D}]" and shapes["reduce-scatter"] == "f32[%d,%d,%d]" % local


@pytest.mark.parametrize("text, expected", [
    ("[4,2]<=[8]", (("tensor",), 2)),  # pairs {0,1},{2,3},...: half of the tensor axis
    ("[2,4]<=[8]", (("tensor",), 4)),
    ("[4,2]<=[2,4]T(1,0)", (("data",), 2)),  # {0,4},{1,5},...
    ("[2,4]<=[4,2]T(1,0)", (("data", "tensor"), 4)),  # {0,2,4,6},{1,3,5,7}
    ("[1,8]<=[8]", (("data", "tensor"), 8)),
    ("{{0,4},{1,5},{2,6},{3,7}}", (("data",), 2)),
    ("{{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add", (("tensor",), 4)),
    ("{}", (("data", "tensor"), 8)),
    ("{{0},{1},{2},{3},{4},{5},{6},{7}}", ((), 1)),
    ("mesh['data'=2,'pipe'=1,'tensor'=4] {'tensor'}, use_global_device_ids=true", (("tensor",), 4)),
    ("mesh['data'=2,'pipe'=1,'tensor'=4] {'tensor','data'}", (("data", "tensor"), 8)),
    ("mesh[data=2,pipe=1,tensor=4] {tensor:(1)2}", (("tensor",), 2)),
    ("mesh['data'=2,'pipe'=1,'tensor'=4] {}", ((), 1)),
])
def test_replica_group_parsing(mesh, text, expected):
    assert hlo.replica_group_axes(text, mesh) == expected


def test_replica_groups_that_disagree_are_reported(mesh):
    notes = []
    assert hlo.replica_group_axes("{{0,1},{2,6}}", mesh, notes) == (("data", "tensor"), 2)
    assert notes and "different axes" in notes[0]


def test_memory_fields(mesh):
    mem = hlo.memory(_compile(lambda x: jnp.tanh(x) @ x.T, jnp.ones((B * 8, D))))
    assert all(isinstance(v, int) and v >= 0 for v in mem.values())
    assert mem["peak_bytes"] >= mem["temp_bytes"] and mem["argument_bytes"] == B * 8 * D * F32


# Hand-written module in the forms the CPU backend does not print: operand shapes inline, async -start/-done
# pairs (the all-gather-start returns (input, output), the permute-start (input, output, context...)), a combined
# tuple all-reduce, iota replica groups, and a while loop without a known trip count.
_ASYNC_HLO = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[2,3,5])) -> (s32[], f32[2,3,5]) {
  %p = (s32[], f32[2,3,5]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[2,3,5]{2,1,0}) %p), index=0
  %x = f32[2,3,5]{2,1,0} get-tuple-element((s32[], f32[2,3,5]{2,1,0}) %p), index=1
  %z = bf16[] constant(1)
  %y = bf16[7]{0} broadcast(bf16[] %z), dimensions={}
  %ars = (f32[2,3,5]{2,1,0}, bf16[7]{0}) all-reduce-start(f32[2,3,5]{2,1,0} %x, bf16[7]{0} %y), channel_id=1, \
replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = (f32[2,3,5]{2,1,0}, bf16[7]{0}) all-reduce-done((f32[2,3,5]{2,1,0}, bf16[7]{0}) %ars)
  %ags = (f32[2,3,5]{2,1,0}, f32[2,12,5]{2,1,0}) all-gather-start(f32[2,3,5]{2,1,0} %x), channel_id=2, \
replica_groups=[2,4]<=[8], dimensions={1}, use_global_device_ids=true
  %agd = f32[2,12,5]{2,1,0} all-gather-done((f32[2,3,5]{2,1,0}, f32[2,12,5]{2,1,0}) %ags)
  %cps = (f32[2,3,5]{2,1,0}, f32[2,3,5]{2,1,0}, u32[], u32[]) collective-permute-start(f32[2,3,5]{2,1,0} %x), \
channel_id=3, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cpd = f32[2,3,5]{2,1,0} collective-permute-done((f32[2,3,5]{2,1,0}, f32[2,3,5]{2,1,0}, u32[], u32[]) %cps)
  %d = f32[2,3,3]{2,1,0} dot(f32[2,3,5]{2,1,0} %x, f32[2,3,5]{2,1,0} %cpd), lhs_batch_dims={0}, \
lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
  ROOT %t = (s32[], f32[2,3,5]{2,1,0}) tuple(s32[] %i, f32[2,3,5]{2,1,0} %x)
}

%cond (q: (s32[], f32[2,3,5])) -> pred[] {
  %q = (s32[], f32[2,3,5]{2,1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x0: (s32[], f32[2,3,5])) -> (s32[], f32[2,3,5]) {
  %x0 = (s32[], f32[2,3,5]{2,1,0}) parameter(0)
  ROOT %w = (s32[], f32[2,3,5]{2,1,0}) while((s32[], f32[2,3,5]{2,1,0}) %x0), condition=%cond, body=%body TRIP
}
"""


def test_async_iota_inline_text_and_unknown_trip_count(mesh):
    text = _ASYNC_HLO.replace(" TRIP", "")
    with pytest.warns(UserWarning, match="no known_trip_count"):
        cols = hlo.collectives(text, mesh)
    n = 2 * 3 * 5 * F32
    got = {c.kind: (c.axes, c.group_size, c.shape, c.bytes, c.sent_bytes, c.count, c.exact) for c in cols}
    assert got == {
        "all-reduce": (("tensor",), 4, "(f32[2,3,5], bf16[7])", n + 14, 2 * 3 / 4 * (n + 14), 1, False),
        "all-gather": (("tensor",), 4, "f32[2,12,5]", 4 * n, 3 / 4 * 4 * n, 1, False),
        "collective-permute": (("data",), 2, "f32[2,3,5]", n, n, 1, False),
    }
    with pytest.warns(UserWarning):
        assert hlo.dot_flops(text) == 2 * (2 * 3 * 3) * 5

    known = _ASYNC_HLO.replace(" TRIP", ', backend_config={"known_trip_count":{"n":"7"}}')
    assert hlo.loop_trip_counts(known) == {"body": 7}
    assert hlo.dot_flops(known) == 7 * 2 * (2 * 3 * 3) * 5
    assert {c.count for c in hlo.collectives(known, mesh)} == {7}

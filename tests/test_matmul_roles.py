"""Matmul roles (jaxpar.matmul.ROLES): every weight matrix is contracted under the role its family `Param` names, and
a policy the plan binds to one role changes exactly that role's matmuls — on one device, under tensor parallelism
with collective matmul, and under a schedule table — against a reference model whose weights of that role were
transformed by hand, in value and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig, MoEConfig, ParallelConfig
from jaxpar.families import family
from jaxpar.matmul import ROLES, Einsum, Policies
from jaxpar.model import Transformer, attention_mask, default_positions, run_layers
from jaxpar.parallel import executor
from jaxpar.parallel.context import SINGLE_DEVICE, Parallel
from jaxpar.train.step import loss_and_grads

from _parity import assert_grads_match, grad_errors, on_layout

# Prime-ish sizes: vocab 131 pads at tensor 2; 16 tokens split over 2 ranks for sequence parallelism; 2 layers split
# over 2 pipeline stages.
LLAMA = dict(vocab_size=131, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=22, max_seq_len=16,
             init_std=0.1)
MOE = MoEConfig(n_experts=5, top_k=2, d_ff=10, shared_d_ff=12, shared_gate=True)
B, T = 8, 16


@jax.custom_vjp
def _round_bf16(w):
    return w.astype(jnp.bfloat16).astype(w.dtype)


_round_bf16.defvjp(lambda w: (_round_bf16(w), None), lambda _, g: (g,))


@dataclasses.dataclass(frozen=True)
class Bf16Weights(Einsum):
    """A test policy with a visible effect: the weight rounded to bf16 (idempotent, as `operand` must be), its
    gradient passed straight through — so its gradients are the reference's at the rounded weights."""

    def operand(self, w, dtype):
        return _round_bf16(w).astype(dtype)


def _config(kind: str) -> ModelConfig:
    return ModelConfig(**LLAMA, moe=MOE) if kind == "moe" else ModelConfig(**LLAMA)


def _by_hand(cfg: ModelConfig, params: nnx.State, role: str) -> nnx.State:
    """params with every layer weight the family marks as `role` rounded to bf16 (the reference's weights)."""
    names = {name for name, spec in family(cfg).layer_params(cfg, cfg.moe.enabled).items() if spec.role == role}
    assert names, role

    def by_hand(path, v):
        keys = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
        return _round_bf16(v) if "blocks" in keys and keys & names else v

    return jax.tree_util.tree_map_with_path(by_hand, params)


@dataclasses.dataclass(frozen=True)
class Tagged(Einsum):
    """Records (role, shape) of every weight it prepares or reads as a table."""

    role: str = ""
    seen: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def operand(self, w, dtype):
        self.seen.append((self.role, tuple(w.shape)))
        return super().operand(w, dtype)

    def table(self, w, dtype):
        self.seen.append((self.role, tuple(w.shape)))
        return super().table(w, dtype)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "moe"])
def test_every_weight_is_contracted_under_its_params_role(kind):
    """Traced once (no compile): the roles the model names at its call sites are the ones the family's `Param`s
    carry — each layer matrix under its role, the embedding table under `embedding`, the LM head (tied: the
    embedding transposed) under `head` — and nothing else passes the seam."""
    cfg = ModelConfig(**LLAMA, family="gpt2", tie_embeddings=True) if kind == "gpt2" else _config(kind)
    seen = []
    table = Policies(tuple((role, Tagged(role, seen)) for role in ROLES))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    jax.eval_shape(lambda t: model(t, par=Parallel(matmul=table)), jnp.zeros((2, 8), jnp.int32))
    V, D = cfg.vocab_size, cfg.d_model
    want = {(spec.role, spec.shape) for spec in family(cfg).layer_params(cfg, cfg.moe.enabled).values() if spec.role}
    want |= {("embedding", (V, D)), ("head", (D, V))}
    assert set(seen) == want
    assert {role for role, _ in want} == (set(ROLES) if kind == "moe" else set(ROLES) - {"experts", "router"})


def test_policies_bind_roles_by_name():
    policy = Bf16Weights()
    assert Policies().for_role("mlp") == Einsum()
    assert Policies.of(mlp=policy).for_role("mlp") is policy
    assert Policies.of(mlp=policy).for_role("head") == Einsum()
    blocks = Policies.blocks(policy)
    assert [blocks.for_role(r) is policy for r in ROLES] == [True, True, True, False, False, False]
    assert hash(Policies.of(mlp=policy, attention=policy)) == hash(Policies.of(attention=policy, mlp=policy))
    with pytest.raises(ValueError, match="matmul roles"):
        Policies.of(lm_head=policy)
    with pytest.raises(ValueError, match="matmul role"):
        Policies().for_role("ffn")


@pytest.fixture(scope="module", params=[("llama", "mlp"), ("moe", "experts")], ids=lambda p: f"{p[0]}-{p[1]}")
def reference(request):
    """(cfg, role, batch, params, the policy's loss and grads on one device, the hand-rounded reference's)."""
    kind, role = request.param
    cfg = _config(kind)
    batch = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    plain = jax.jit(loss_and_grads(graphdef))
    policy = jax.jit(loss_and_grads(graphdef, par=Parallel(matmul=Policies.of(**{role: Bf16Weights()}))))
    return cfg, role, batch, params, policy(params, batch), plain(params, batch), plain(_by_hand(cfg, params, role),
                                                                                     batch)


def test_a_role_policy_matches_the_hand_transformed_reference(reference):
    """One device: a policy bound to one role gives the loss and every gradient of the model whose weights of that
    role were rounded by hand — the router, embedding, head and the other roles untouched — and visibly differs
    from the plain model."""
    cfg, role, batch, params, (loss, grads), (plain_loss, plain_grads), (want_loss, want_grads) = reference
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)
    assert max(grad_errors(grads, plain_grads).values()) > 1e-4  # the policy did something


@pytest.mark.parametrize("layout", [
    dict(data=4, tensor=2, sequence_parallel=True, overlap="collective_matmul"),
    dict(data=2, pipe=2, tensor=2, microbatches=2, schedule="zb_h1"),
], ids=["tp+sp+cm", "zb_h1+tp"])
def test_a_role_policy_matches_the_reference_on_a_layout(reference, layout):
    """The plan binds the policy (`make_plan(matmul=)`): under tensor parallelism with collective matmul (the ring
    prepares each weight once and contracts each chunk) and under a schedule table (the executor prepares a
    chunk's weights by their roles, and W replays through the policy), the loss and every gradient equal the
    hand-rounded reference's."""
    cfg, role, batch, params, _, _, (want_loss, want_grads) = reference
    if cfg.moe.enabled and "overlap" in layout:
        pytest.skip("the experts' group has no collective matmul; the MoE model runs the schedule table")
    loss, grads = on_layout(cfg, params, batch, ParallelConfig(**layout), matmul=Policies.of(**{role: Bf16Weights()}))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)


def test_the_executor_prepares_each_weight_by_its_role():
    """The table executor learns each weight's role from the tape (the role the model named for its group) and
    prepares the weight with that role's `operand`: the block's matrices by name, the router (a dot outside any
    group, differentiated in B) not among them."""
    cfg = _config("moe")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    prepared = {}

    def trace(stacks, x):
        positions, mask = default_positions(*x.shape[:2]), attention_mask(x.shape[1], None)

        def chunk_fn(chunk, x, tape, consts):  # as the train step's: the tape rides on the context (`Tape.scan`)
            return run_layers(chunk, x, positions, mask, cfg, par=SINGLE_DEVICE.with_tape(tape), stats=True)

        def operand(w, role):
            prepared[id(w)] = role
            return w

        chunk = executor.Chunk(chunk_fn, stacks, jax.tree.map(lambda a: a * 1, stacks), x, operand)
        paths = [jax.tree_util.keystr(p, simple=True, separator="/")
                 for p, _ in jax.tree_util.tree_flatten_with_path(stacks)[0]]
        roles.update({path.split("/")[-1]: role for path, role in
                      zip([p for p, w in zip(paths, chunk.is_matmul) if w], chunk.roles)})
        assert set(prepared.values()) <= set(chunk.roles)
        return x

    roles = {}
    jax.eval_shape(trace, model.stacks(), jax.ShapeDtypeStruct((2, 8, cfg.d_model), jnp.float32))
    specs = family(cfg).layer_params(cfg, True)
    assert roles == {name: spec.role for name, spec in specs.items() if spec.role in ("attention", "mlp", "experts")}


def test_collective_matmul_prepares_each_weight_once():
    """The ring (jaxpar.parallel.overlap) prepares each weight once in the forward and once in the backward —
    `operand` outside the ring, `contract` per chunk — not once per chunk, at t = 4 (traced, no compile)."""
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxpar.parallel import overlap

    seen = []

    @dataclasses.dataclass(frozen=True)
    class Counting(Einsum):
        def operand(self, w, dtype):
            seen.append(w.shape)
            return super().operand(w, dtype)

    policy, eq_in, eq_out = Counting(), "btd,df->btf", "btf,fd->btd"

    def loss(h, w_gate, w_up, w_down):
        gate, up = overlap.gather_matmuls(h, (w_gate, w_up), (eq_in, eq_in), "tensor", policy)
        return overlap.matmul_scatter((gate * up).astype(h.dtype), w_down, eq_out, "tensor", policy).sum()

    specs = (P(None, "tensor"), P(None, "tensor"), P(None, "tensor"), P("tensor", None))
    step = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2, 3)), mesh=Mesh(np.array(jax.devices()[:4]), ("tensor",)),
                         in_specs=specs, out_specs=specs, check_vma=False)
    D, F = 6, 8
    jax.make_jaxpr(step)(jnp.zeros((2, 8, D)), jnp.zeros((D, F)), jnp.zeros((D, F)), jnp.zeros((F, D)))
    assert sorted(seen) == sorted([(D, F // 4)] * 4 + [(F // 4, D)] * 2)  # each weight: forward, backward

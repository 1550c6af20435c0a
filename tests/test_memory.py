"""The memory planner: exact accounting, real configs, clear errors."""

import dataclasses
import functools
import importlib.util
import json
import math

import jax
import pytest

from logra_jax import memory
from logra_jax import models
from logra_jax import parallel
from logra_jax.cli import main as cli_main
from logra_jax.memory import targets

TINY = models.DecoderConfig.tiny(vocab_size=64)
FSDP8 = parallel.MeshConfig(fsdp=8)


@pytest.fixture(scope="module")
def reports():
  return {
      opt: memory.plan_memory(
          TINY, mesh=FSDP8, optimizer=opt, rank=8, seq_len=64, micro_batch=2
      )
      for opt in ("adam", "logra")
  }


def _num_params(config):
  return sum(math.prod(s) for s in models.decoder.param_shapes(config).values())


def test_sharded_sizes_follow_the_closed_form(reports):
  adam = reports["adam"]
  # Every weight of the tiny config divides by 8 along its sharded axis.
  assert adam.num_params == _num_params(TINY)
  assert adam.params == adam.grads == 4 * adam.num_params // 8
  # AdamW: float32 mu and nu laid out like the params, plus int32 counters.
  assert 2 * adam.params <= adam.optimizer_state <= 2 * adam.params + 64
  # 16 sequences of 64 tokens over 8 devices: int32 tokens and masks,
  # float32 old log-probs and advantages.
  rows, prompt, completion = 2, 16, 48
  assert adam.batch == rows * (
      2 * prompt * 4 + 2 * completion * 4 + completion * 4 + 4
  )


def test_parts_add_up_and_logra_holds_less_state(reports):
  for report in reports.values():
    assert report.total == (
        report.params
        + report.optimizer_state
        + report.batch
        + report.grads
        + report.temporaries
        + report.outputs
        + report.rollout
    )
    assert report.temporaries > 0 and report.fits is None
  assert reports["logra"].optimizer_state < reports["adam"].optimizer_state


def test_factored_weights_add_their_window_and_a_bfloat16_base_halves(reports):
  """LoGRA with sketch-direct gradients keeps each projected matrix as
  B + P A: B laid out like the parameter, A ([L, r, short] float32) split over
  fsdp; with a bfloat16 base, B takes 2 bytes per parameter; quantized
  steps add their residual and codes to the optimizer state."""
  shapes = models.decoder.param_shapes(TINY)
  matrices = [s for s in shapes.values() if len(s) == 3]  # [L, in, out]
  coords = sum(L * 8 * min(m, n) for L, m, n in matrices) * 4 // 8
  assert reports["logra"].params == reports["adam"].params + coords
  # The logra report's plan, with a bfloat16 base (and more, below).
  plan = functools.partial(
      memory.plan_memory,
      TINY,
      mesh=FSDP8,
      rank=8,
      seq_len=64,
      micro_batch=2,
      base_dtype="bfloat16",
  )
  bf16 = plan(step_bits=8)
  projected = sum(math.prod(s) for s in matrices)
  assert bf16.params == reports["logra"].params - 2 * projected // 8
  # No float32 copy of the bfloat16 base appears in the plan (XLA:CPU upcasts
  # bfloat16 dots; the planner keeps those converts inside the layer loop).
  assert bf16.temporaries < reports["logra"].temporaries + 2 * projected // 8
  assert "bfloat16 base" in bf16.description
  # bfloat16 coordinates: A takes 2 bytes per value.
  halved = plan(coords_dtype="bfloat16")
  assert halved.params == bf16.params - coords // 2
  assert "bfloat16 coordinates" in halved.description
  with pytest.raises(ValueError, match="optimizer.coords_dtype"):
    memory.plan_memory(
        TINY, mesh=FSDP8, optimizer="adam", coords_dtype="bfloat16"
    )
  # 8-bit steps (the bfloat16 plan's): the optimizer state holds the
  # rounding residual (A's shape, float32) and the last codes (1 byte a
  # value) and exponents (1 byte a row), between split over fsdp and whole
  # on every device, as XLA lays them out.
  rows = sum(L * 8 for L, _, _ in matrices)
  grown = bf16.optimizer_state - reports["logra"].optimizer_state
  whole = 8 * coords + 8 * (coords // 4) + rows  # on one device of 8
  assert coords + coords // 4 <= grown <= whole + 64
  assert "8-bit steps" in bf16.description
  with pytest.raises(ValueError, match="optimizer.base_dtype"):
    memory.plan_memory(
        TINY, mesh=FSDP8, optimizer="adam", base_dtype="bfloat16"
    )


@pytest.mark.slow
def test_projected_embeddings_drop_their_dense_moments_and_gradients(reports):
  config = models.DecoderConfig.tiny(vocab_size=512)
  default, projected = (
      memory.plan_memory(
          config, mesh=FSDP8, rank=8, seq_len=64, project_embeddings=flag
      )
      for flag in (False, True)
  )
  # The [512, 64] table and head: a float32 gradient and two moments each,
  # split over 8 devices, become [8, 64] sketches and two [8, 64] moments
  # each (whole on every device) plus [512, 8] projectors (split).
  embeddings = 2 * 512 * 64 * 4 // 8
  sketches = 2 * 8 * 64 * 4
  projectors = 2 * 512 * 8 * 4 // 8
  assert default.grads - projected.grads == embeddings - sketches
  assert (
      default.optimizer_state - projected.optimizer_state
      == 2 * embeddings - 2 * sketches - projectors
  )
  assert "embeddings projected" in projected.description
  with pytest.raises(ValueError, match="project_embeddings applies to logra"):
    memory.plan_memory(config, optimizer="adam", project_embeddings=True)


def test_projected_vocabulary_that_the_mesh_does_not_divide_is_planned():
  """A vocabulary of 100 projected over fsdp=8: the sketch-direct gradient's
  [100, k] coordinates stay whole on every device (they were once pinned to
  the data axes, which do not divide 100, and the plan raised)."""
  report = memory.plan_memory(
      models.DecoderConfig.tiny(vocab_size=100),
      mesh=FSDP8,
      rank=4,
      seq_len=16,
      project_embeddings=True,
  )
  assert report.total > 0 and "embeddings projected" in report.description


@pytest.mark.slow
def test_sketch_gradients_plan_no_more_than_dense_ones():
  """The issue's config: qwen2.5-0.5b, fsdp=8, seq 2048, rank 64, the tied
  [151936, 896] table projected. A float32 transposed copy of the table kept
  for the rematerialized logits, a hoisted [B, C, V] zero and replicated
  coordinate cotangents once made sketch mode plan above dense mode; the
  factored weights' coordinates A must not either. (On toy configs whose
  vocabulary-sized buffers dwarf the layers, sketch mode still plans ~1%
  above dense: its savings grow with the layers.)"""
  sketch, dense = (
      memory.plan_memory(
          "qwen2.5-0.5b",
          mesh=FSDP8,
          rank=64,
          seq_len=2048,
          gradient_mode=mode,
          project_embeddings=True,
      )
      for mode in ("sketch", "dense")
  )
  assert sketch.grads < dense.grads
  assert sketch.total <= dense.total


def test_rollout_reservation_is_in_the_total():
  report = memory.plan_memory(
      TINY,
      mesh=FSDP8,
      seq_len=32,
      rollout_seqs=8,
      rollout_tokens=128,
      device_memory_gib=1e-6,
      rollout_copy=True,
  )
  assert report.rollout == memory.rollout_reservation(TINY, FSDP8, 8, 128)
  assert report.rollout > 0 and report.total > report.rollout
  assert report.fits is False and "NO, over by" in report.summary()
  # A plan made without the accelerators says so, as the GPU's may differ.
  assert report.compiled_for == report.to_dict()["compiled_for"] == "cpu"
  assert "compiled for CPU" in report.summary()


def test_a_shared_engine_scores_the_prompt_against_itself_only():
  """The sampler's prefill writes into an empty cache: its scores are
  prompt x prompt, not prompt x (cache + prompt). 64 sequences of 2048
  tokens (prompts of 512) once reserved 2.7 GiB, mostly copies of the
  [64, 4 heads, 512, 2559] float32 scores; now less than one of them."""
  tiny = models.DecoderConfig.tiny()
  report = memory.plan_memory(
      tiny, seq_len=32, rollout_seqs=64, rollout_tokens=2048
  )
  prompt, cache = 2048 // 4, 2048 - 1
  scores = 64 * tiny.num_heads * prompt * (cache + prompt) * 4
  assert 0 < report.rollout < scores


def test_a_shared_engine_and_the_step_take_turns_an_own_copy_adds_up():
  """The zero-copy engine samples between train steps (no rollout worker
  thread at rollout.max_staleness=0), so the plan's total is the resident
  state plus the larger phase; an engine with its own copy samples beside
  the step, and everything adds up."""
  shared = memory.plan_memory(
      TINY, seq_len=32, rollout_seqs=64, rollout_tokens=512
  )
  step = shared.batch + shared.grads + shared.temporaries + shared.outputs
  assert shared.rollout_between_steps and shared.rollout > step
  assert shared.total == (
      shared.params + shared.optimizer_state + shared.reference + shared.rollout
  )
  assert "total (peak phase)" in shared.summary()
  own = memory.plan_memory(
      TINY, seq_len=32, rollout_seqs=64, rollout_tokens=512, rollout_copy=True
  )
  assert not own.rollout_between_steps
  own_step = own.batch + own.grads + own.temporaries + own.outputs
  assert own.total == (
      own.params + own.optimizer_state + own.reference + own.rollout + own_step
  )
  assert shared.train_total == own.train_total == own.total - own.rollout


def test_a_shared_engine_reserves_its_cache_not_the_weights():
  """The default colocated engine samples with the learner's arrays: its
  reservation is the sampling program's temporaries and outputs, which hold
  the KV cache (float32 here: the compute dtype) but no weights. On a model
  whose weights outweigh its rollout, that is less than a bfloat16 copy."""
  wide = dataclasses.replace(
      TINY, hidden_size=256, intermediate_size=1024, vocab_size=4096
  )
  shared = memory.plan_memory(
      wide, seq_len=32, rollout_seqs=2, rollout_tokens=16
  )
  copy = memory.rollout_reservation(wide, parallel.MeshConfig(), 2, 16)
  cache = 2 * wide.num_layers * wide.num_kv_heads * wide.head_dim * 4 * 2 * 16
  assert cache <= shared.rollout < copy
  assert "(shared weights)" in shared.summary()


@pytest.mark.parametrize(
    "mesh, data, kv_parts",
    [("fsdp=8", 8, 1), ("fsdp=4,tp=2", 4, 2), ("fsdp=2,tp=4", 2, 1)],
)
def test_rollout_kv_cache_is_laid_out_as_the_sampler_lays_it(
    mesh, data, kv_parts
):
  """Sequences over the data axes, padded up to a multiple of them; TINY's 2
  key/value heads over tp where tp divides them (tp=4 does not: whole)."""
  mesh = parallel.MeshConfig.parse(mesh)
  reserve = lambda seqs: memory.rollout_reservation(TINY, mesh, seqs, 128)
  per_sequence = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 2
  per_sequence *= 128
  assert TINY.num_kv_heads == 2
  assert reserve(1) == reserve(data)  # one row per data shard, padded
  assert reserve(data + 1) - reserve(data) == per_sequence // kv_parts
  assert reserve(1) - reserve(0) == per_sequence // kv_parts


def test_rollout_weights_are_whole_on_each_data_parallel_replica():
  weights = lambda mesh: memory.rollout_reservation(
      TINY, parallel.MeshConfig.parse(mesh), 0, 128
  )
  num_params = sum(
      math.prod(p.shape)
      for p in jax.tree.leaves(models.split_model(models.init_model(TINY))[1])
  )
  assert weights("dp=2,fsdp=2,tp=2") == weights("fsdp=2,tp=2")
  assert weights("dp=8") == 2 * num_params
  assert 2 * num_params / 8 <= weights("fsdp=8") < 2 * num_params / 4


@pytest.mark.slow
def test_less_remat_needs_more_temporaries():
  full, none = (
      memory.plan_memory(
          TINY, seq_len=256, micro_batch=4, remat=remat
      ).temporaries
      for remat in ("block", "none")
  )
  assert none > full


# Parameter counts published with the checkpoints.
@pytest.mark.parametrize(
    "name,count",
    [
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen2.5-1.5b", 1_543_714_304),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-14b", 14_770_033_664),
        ("qwen2.5-32b", 32_763_876_352),
        ("qwen3-8b", 8_190_735_360),
        ("qwen3-32b", 32_762_123_264),
    ],
)
def test_presets_have_the_published_parameter_counts(name, count):
  assert _num_params(memory.load_model_config(name)) == count


def test_27b_preset_has_27b_parameters():
  count = _num_params(memory.load_model_config("qwen3-style-27b"))
  assert 26.5e9 < count < 27.5e9


def test_config_json_is_read(tmp_path):
  fields = dict(memory.MODEL_PRESETS["qwen3-8b"], num_hidden_layers=2)
  (tmp_path / "config.json").write_text(json.dumps(fields))
  config = memory.load_model_config(str(tmp_path))
  assert config.num_layers == 2 and config.qk_norm


@pytest.mark.parametrize(
    "model,match",
    [
        ("llama-7b", "unknown model 'llama-7b': not one of"),
        ("missing/config.json", "does not exist"),
    ],
)
def test_bad_model_names_are_clear_errors(model, match):
  with pytest.raises(ValueError, match=match):
    memory.load_model_config(model)


def test_unsupported_architecture_is_rejected(tmp_path):
  path = tmp_path / "config.json"
  path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
  with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
    memory.load_model_config(str(path))


@pytest.mark.parametrize(
    "text,match",
    [
        ("[1, 2]", "holds a JSON list, not an object"),
        ("{not json", "Expecting property name"),
        (
            json.dumps(dict(memory.MODEL_PRESETS["qwen3-8b"], hidden_size="a")),
            "not a valid qwen3 config: .*hidden_size",
        ),
    ],
)
def test_a_bad_config_json_is_one_clear_error(tmp_path, text, match):
  path = tmp_path / "config.json"
  path.write_text(text)
  with pytest.raises(ValueError, match=match):
    memory.load_model_config(str(path))


def test_cli_json_and_errors(capsys):
  assert (
      cli_main(
          [
              "memory",
              "--model",
              "qwen2.5-0.5b",
              "--mesh",
              "fsdp=3",
              "--seq",
              "64",
          ]
      )
      == 2
  )
  assert "not divisible by mesh axis fsdp of size 3" in capsys.readouterr().err
  assert cli_main(["memory", "--model", "qwen2.5-0.5b", "--mesh", "pp=8"]) == 2
  assert "expected axis=size" in capsys.readouterr().err
  assert (
      cli_main(
          [
              "memory",
              "--model",
              "qwen2.5-0.5b",
              "--optimizer",
              "adam",
              "--project-embeddings",
          ]
      )
      == 2
  )
  assert "--project-embeddings applies to logra" in capsys.readouterr().err
  # A config check's message names the planner's flags, not the fields.
  argv = ["memory", "--model", "qwen2.5-0.5b", "--optimizer", "lora"]
  assert cli_main(argv + ["--freeze-embeddings"]) == 2
  error = capsys.readouterr().err
  assert "error: --freeze-embeddings does not apply to lora" in error
  assert "optimizer.lora_targets" in error  # no flag of its own
  argv[-1] = "adam"
  assert cli_main(argv + ["--step-bits", "4"]) == 2
  assert "got --optimizer='adam'" in capsys.readouterr().err
  kl = ["--target-kl", "0.1", "--kl-subsample", "16", "--micro-batch", "2"]
  assert cli_main(argv + kl + ["--mesh", "fsdp=1"]) == 2
  assert (
      "error: --kl-subsample=16 exceeds the planned batch of 2 sequences "
      "(--micro-batch x --micro-batches x the mesh's dp x fsdp)"
  ) in capsys.readouterr().err
  assert (
      cli_main(
          [
              "memory",
              "--model",
              "qwen2.5-0.5b",
              "--mesh",
              "fsdp=8",
              "--seq",
              "64",
              "--json",
              "--device-memory-gib",
              "80",
          ]
      )
      == 0
  )
  report = json.loads(capsys.readouterr().out)
  assert {
      "params",
      "grads",
      "optimizer_state",
      "temporaries",
      "rollout",
      "total",
      "fits",
  } <= set(report)
  assert report["fits"] is True and report["num_params"] == 494_032_768


@pytest.mark.slow
def test_kl_control_is_planned_over_the_whole_batch(capsys):
  """``--target-kl`` compiles the step with the KL predictor (a forward pass
  and its JVP over the whole batch: every micro-batch, or ``--kl-subsample``
  sequences of it): predicting on four micro-batches' sequences needs at
  least a float32 row of logits more per added sequence than predicting on
  one micro-batch's. A non-positive target, a subsample beyond the batch, one the
  data axes do not divide, or one without a target is one line, exit 2,
  before anything compiles."""
  wide = dataclasses.replace(TINY, vocab_size=8192)

  def temporaries(**kwargs):
    return memory.plan_memory(
        wide, rank=8, seq_len=32, micro_batch=2, micro_batches=4, **kwargs
    ).temporaries

  one_chunk, whole = (
      temporaries(target_kl=0.01, kl_subsample=n) for n in (2, None)
  )
  assert whole - one_chunk >= 6 * wide.vocab_size * 4, (one_chunk, whole)
  report = memory.plan_memory(
      wide, rank=8, seq_len=32, micro_batch=2, micro_batches=4, target_kl=0.01
  )
  assert "KL control (target 0.01)" in report.description
  assert "micro-batch 2/device x 4 micro-batches" in report.description
  for kwargs, problem in (
      ({"kl_subsample": 9}, "kl_subsample=9 exceeds the planned batch of 8"),
      ({"kl_subsample": 1, "target_kl": None}, "kl_subsample needs target_kl"),
  ):
    with pytest.raises(ValueError, match=problem):
      memory.plan_memory(
          TINY,
          seq_len=32,
          micro_batch=2,
          micro_batches=4,
          **{"target_kl": 0.01, **kwargs},
      )
  for value in ("0", "nan"):
    with pytest.raises(SystemExit) as info:
      cli_main(["memory", "--model", "qwen2.5-0.5b", "--target-kl", value])
    assert info.value.code == 2
    assert "--target-kl: expected a finite number > 0" in (
        capsys.readouterr().err
    )
  assert (
      cli_main(
          ["memory", "--model", "qwen2.5-0.5b", "--target-kl", "0.01"]
          + ["--kl-subsample", "2", "--mesh", "fsdp=8"]
      )
      == 2
  )
  assert "--kl-subsample=2 is not divisible by the mesh's data axes (8" in (
      capsys.readouterr().err
  )


CUDA_PLUGIN = bool(
    importlib.util.find_spec("jax_plugins")
    and importlib.util.find_spec("jax_plugins.xla_cuda12")
)


def test_gpu_targets_describe_each_part_and_unknown_ones_are_refused():
  for name in memory.GPU_TARGETS:
    text = targets.target_config(name)
    assert f'device_description_str: "{name}"' in text
    assert "cuda_compute_capability { major: " in text
  with pytest.raises(ValueError, match="known: a100-80gb, h100, h200"):
    targets.target_config("v100")
  with pytest.raises(SystemExit):
    cli_main(["memory", "--compile-for", "v100"])


@pytest.mark.skipif(CUDA_PLUGIN, reason="JAX's CUDA plugin is installed")
def test_compiling_for_a_gpu_without_the_plugin_says_how_to_get_it():
  with pytest.raises(
      ValueError, match="pip install --no-deps jax-cuda12-plugin"
  ):
    memory.ensure_devices(1, "h200")


@pytest.mark.skipif(not CUDA_PLUGIN, reason="JAX's CUDA plugin is missing")
def test_a_plan_compiled_for_a_gpu_without_one_is_xla_gpu_s():
  """Compile-only H200 devices, on a machine without a GPU: the plan's
  parts are XLA:GPU's (its cuBLAS workspace among the temporaries)."""
  report = memory.plan_memory(
      TINY, mesh=FSDP8, rank=8, seq_len=64, compile_for="h200"
  )
  assert report.compiled_for == "gpu"
  assert (
      report.params
      == memory.plan_memory(TINY, mesh=FSDP8, rank=8, seq_len=64).params
  )

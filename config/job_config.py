"""The job's configuration schema, one typed dataclass per section. The string under each field is its
documentation (``--help``); ``[training] steps = 20`` in TOML is ``--training.steps 20`` on the command line."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Literal

from config.evaluation import Evaluation
from config.fault_tolerance import FaultTolerance
from config.generation import Generation
from config.plan import Plan

# No torch here, so config mistakes are reported in seconds. Dtype options take torch's names.
RESOLVED_CONFIG_FILE = "config.toml"  # in job.dump_folder: the run's options as TOML, after this header
RESOLVED_CONFIG_HEADER = "# The options of the run in this folder, written (and rewritten) by the run\n"


def written_by_a_run(path: str) -> bool:
    """Whether ``path`` is a resolved config a run wrote (its first line is the header)."""
    with open(path, errors="replace") as f:
        return f.readline() == RESOLVED_CONFIG_HEADER


METRICS_FILE = "metrics.jsonl"  # in job.dump_folder: one JSON record per logged step
VALIDATION_FILE = "validation.jsonl"  # and one per validation

CheckpointPart = Literal["model", "optimizer", "lr_scheduler", "dataloader", "train_state"]
CHECKPOINT_PARTS: tuple[str, ...] = typing.get_args(CheckpointPart)


@dataclass
class Job:
    config_file: str = ""
    """TOML file with the job's settings; command-line flags override it."""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, metrics, TensorBoard, checkpoints."""
    description: str = ""
    """Free text describing the job, logged at start."""
    print_config: bool = False
    """Log the resolved config at start (it is always written to <dump_folder>/config.toml)."""
    save_config_file: str = ""
    """Also write the resolved config as JSON to this file in the dump folder (as torchtitan); empty = not."""
    run_name: str = ""
    """TensorBoard run sub-folder under <dump_folder>/tb; empty = a timestamp."""
    cache_dir: str = field(
        default_factory=lambda: os.environ.get("TESSERA_CACHE_DIR") or os.path.expanduser("~/.cache/tessera")
    )
    """Where the default tokenizer and tokenized corpora are cached (env TESSERA_CACHE_DIR)."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family from the registry."""
    flavor: str = "debugmodel"
    """Size within the family: debugmodel, debugmodel_wide, 1B, 3B (Llama 3.2), 8B, 70B, 405B (Llama 3.1)."""
    architecture: str = "auto"
    """Where the sizes come from: 'flavor', a Hugging Face folder (or its config.json), or 'auto'
    (checkpoint.initial_load_path if a Hugging Face folder, else the flavor). Fields below override either."""
    dim: int | None = None
    """Width of the residual stream (HF hidden_size); unset = the architecture's."""
    n_layers: int | None = None
    """Transformer blocks (HF num_hidden_layers); unset = the architecture's."""
    n_heads: int | None = None
    """Query heads (HF num_attention_heads); unset = the architecture's."""
    n_kv_heads: int | None = None
    """Key/value heads of grouped-query attention (HF num_key_value_heads); unset = the architecture's."""
    ffn_dim: int | None = None
    """SwiGLU width (HF intermediate_size); unset = the architecture's, or from ffn_dim_multiplier/multiple_of."""
    ffn_dim_multiplier: float | None = None
    """Factor on the default SwiGLU width int(8 * dim / 3); unset = the architecture's."""
    multiple_of: int | None = None
    """The derived SwiGLU width is rounded up to a multiple of this; unset = the architecture's."""
    norm_eps: float | None = None
    """RMSNorm epsilon (HF rms_norm_eps); unset = the architecture's."""
    rope_theta: float | None = None
    """RoPE base (HF rope_theta); unset = the architecture's."""
    use_rope_scaling: bool | None = None
    """Llama 3.1 RoPE frequency scaling (HF rope_type llama3); unset = the architecture's."""
    rope_scaling_factor: float | None = None
    """RoPE scaling: divisor of the low-frequency bands (HF factor); unset = the architecture's."""
    rope_low_freq_factor: float | None = None
    """RoPE scaling: HF low_freq_factor; unset = the architecture's."""
    rope_high_freq_factor: float | None = None
    """RoPE scaling: HF high_freq_factor; unset = the architecture's."""
    rope_original_max_position_embeddings: int | None = None
    """RoPE scaling: the original context length (HF original_max_position_embeddings); unset = the architecture's."""
    max_position_embeddings: int | None = None
    """Context length in a Hugging Face export's config.json; unset = the architecture's, else training.seq_len."""
    tie_word_embeddings: bool | None = None
    """The output head reuses the token embedding table; unset = the architecture's."""
    vocab_size: int | None = None
    """Embedding/output vocabulary, holding every tokenizer id; unset = an HF architecture's, else the tokenizer's."""
    tokenizer_path: str = ""
    """A Hugging Face tokenizer folder (torchtitan's model.hf_assets_path) or its tokenizer.json, a sentencepiece
    .model or a tiktoken BPE file; empty = a tokenizer trained on the default corpus."""
    default_tokenizer_vocab_size: int = 2048
    """Vocabulary of the tokenizer trained on first use when tokenizer_path is empty (at least 349)."""
    converters: list[Literal["float8"]] = field(default_factory=list)
    """Conversions before parallelizing: float8 trains nn.Linear in float8 (torchao's Float8Linear; see [float8])."""
    print_after_conversion: bool = False
    """Log the model's modules after the conversions (rank 0)."""


# The [model] fields that, when set, override the architecture's (all and only those unset by default).
MODEL_SIZE_FIELDS = tuple(f.name for f in dataclasses.fields(Model) if f.default is None)

# The default corpus's distinct characters, each of which the default tokenizer must hold.
DEFAULT_TOKENIZER_MIN_VOCAB = 349


@dataclass
class Training:
    dataset: str = "python_docs"
    """'python_docs' (Python's docs); .txt/.jsonl files, a folder or comma-separated list of them, Parquet/Arrow/JSON
    shards (via `datasets`), or a hub dataset (streamed; 'c4' is allenai/c4 'en')."""
    dataset_config: str = ""
    """Configuration (subset) of a hub dataset, e.g. 'en' for allenai/c4; empty = its default."""
    dataset_split: str = "train"
    """Split of a hub dataset; local files are read whole."""
    dataset_text_field: str = "text"
    """The record field holding a document's text (.jsonl, Parquet, Arrow, JSON, hub datasets)."""
    datasets: list[str] = field(default_factory=list)
    """Several corpora (each in the forms of `dataset`) mixed at `dataset_weights`; set, it replaces `dataset`."""
    dataset_weights: list[float] = field(default_factory=list)
    """Each of `datasets`' share of the samples, positive (normalised to sum 1); empty = equal shares."""
    dataset_format: Literal["text", "chat"] = "text"
    """text: documents in dataset_text_field; chat: conversations in a 'messages' field (role, content), rendered
    with the tokenizer folder's chat_template, the loss on the assistant's tokens only."""
    document_masking: Literal["auto", "on", "off"] = "auto"
    """Packed documents attend only within themselves and their positions restart; auto = on for chat data and for
    block-causal flavors (torchtitan's flex and varlen ones)."""
    dataset_prepare_workers: int = 0
    """Processes per node that tokenize a corpus into token shards on first use; 0 = one per core."""
    seq_len: int = 256
    """Tokens per training sequence."""
    local_batch_size: int = 8
    """Sequences per rank per microbatch."""
    global_batch_size: int = -1
    """Sequences per optimizer step, all DP ranks; -1 = local x DP degree; multiples of that accumulate gradients."""
    steps: int = 100
    """Optimizer steps to train."""
    max_norm: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables clipping."""
    mixed_precision_param: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype; auto = bfloat16 where fast (GPUs with bf16, CPUs with AVX512-BF16 or AMX), else float32.
    Sharded data parallelism casts the parameters; without it the forward runs under autocast, as torchtitan's."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights, gradients and optimizer state. bfloat16 (torchtitan's pure bf16) halves their memory and
    keeps no float32 copy, so small updates can round away; the compute then runs in bfloat16 too."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction across data-parallel ranks: float32 or bfloat16."""
    enable_cpu_offload: bool = False
    """Keep the sharded weights, gradients and optimizer state in host memory and step the optimizer there; each
    gather copies its shard to the device first. Needs sharded data parallelism (data_parallel_shard_degree > 1)."""
    dataloader_num_workers: int = 0
    """Data-loading worker processes per rank."""
    nonfinite_policy: Literal["error", "skip_step", "rollback"] = "error"
    """On a non-finite loss or gradient norm: error (stop; a restart resumes from the last checkpoint), skip_step
    (drop the update and the batch) or rollback (reload the last checkpoint, go on past the batches since)."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class: AdamW or Adam."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: Literal["foreach", "fused", "for-loop"] = "fused"
    """Kernel: fused (one pass over each tensor, where the device has it: CUDA and CPU do), foreach or for-loop."""
    early_step_in_backward: bool = False
    """Step each parameter once backward has its gradient, then free it: gradients are never all held at
    once. No clipping (the norm is still logged), no skip_step nonfinite_policy, no pipeline parallelism."""


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    """Steps of linear warmup to the peak learning rate."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay after warmup: linear, cosine or sqrt."""
    decay_ratio: float | None = None
    """Fraction of all steps spent decaying at the end (WSD); unset = decay over all steps after warmup."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of the peak, reached one step after the last (as in torchtitan)."""
    total_steps: int | None = None
    """Steps the schedule spans; unset = training.steps. Longer, a short run follows a long run's first steps."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Ranks holding full replicas (DDP, or the replicate dimension of HSDP)."""
    data_parallel_shard_degree: int = -1
    """Ranks sharding the parameters (FSDP, or the shard dimension of HSDP); -1 = the rest."""
    tensor_parallel_degree: int = 1
    """Ranks splitting each layer's matmuls (tensor parallelism)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages."""
    context_parallel_degree: int = 1
    """Ranks splitting each sequence (context parallelism): each holds 2 of its 2 x degree chunks,
    head and tail, and attention crosses the split; the parameters shard over these ranks too."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How context-parallel attention reaches the other ranks' keys and values: allgather gathers
    them all; alltoall passes them round the ring, one rank's block at a time."""
    data_parallel_impl: Literal["fsdp2", "simple_fsdp"] = "fsdp2"
    """Data-parallel implementation: fsdp2 (torch's fully_shard) or simple_fsdp."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: default (always, except under pipeline parallel), always or never."""
    fsdp_forward_prefetch: int | None = None
    """Gathers issued ahead of the one in use in forward: N = the next N blocks (FSDP2) or buckets (compiled
    SimpleFSDP), -1 = all; unset = the implementation's own (FSDP2: none explicit, SimpleFSDP: one bucket)."""
    fsdp_backward_prefetch: int | None = None
    """Likewise in backward, in backward's order; unset = one ahead (SimpleFSDP: one transfer at a time beside
    compute). More gathers ahead hold more gathered weights at once."""
    enable_loss_parallel: bool = True
    """Under tensor parallelism, compute the cross-entropy on the vocabulary-sharded logits."""
    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with matmuls (GPU only; needs compile)."""
    pipeline_parallel_schedule: Literal[
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "PipelineScheduleSingle",
        "PipelineScheduleMulti",
    ] = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble; or
    PipelineScheduleSingle (one stage per rank) or PipelineScheduleMulti (two) running pipeline_parallel_schedule_csv."""
    pipeline_parallel_schedule_csv: str = ""
    """A custom schedule: a CSV file of each pipeline rank's actions in order (torch's format, e.g. 0F0,0F1,0B0),
    run by torch's pipeline runtime; the schedule's name still gives the stages per rank."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Blocks per (virtual) stage: ceil((layers + first and last stage weights) / this) stages; unset =
    one stage per rank (two for multi-stage schedules), blocks shared as evenly as the end weights allow."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """Without split_points: the first stage counts its embeddings as this many blocks, and gets that many fewer."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """Likewise for the last stage's final norm and output layer."""
    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Explicit stage boundaries, e.g. 'layers.2,layers.4': each named layer starts a stage."""
    module_fqns_per_model_part: list[list[str]] = field(default_factory=list)
    """Explicit stages by their modules: in TOML a list of lists ([["tok_embeddings", "layers.0"], ["layers.1",
    "norm", "output"]]); on the command line stages joined by ',' and a stage's modules by '+'."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch; the local batch is split into microbatches of this size."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save distributed checkpoints and resume from the newest complete one at start."""
    folder: str = "checkpoint"
    """Checkpoint folder inside the dump folder; each checkpoint is a step-N sub-folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled (training waits), async (a background thread saves) or async_with_pinned_mem (pinned staging)."""
    keep_latest_k: int = 10
    """Keep only the newest k complete checkpoints, deleting older ones in the background; 0 = keep all."""
    load_step: int = -1
    """Resume from step-N exactly instead of the newest complete checkpoint; -1 = the newest."""
    exclude_from_loading: list[CheckpointPart] = field(default_factory=list)
    """Parts not restored on resume: any of model, optimizer, lr_scheduler, dataloader, train_state."""
    initial_load_path: str = ""
    """With no checkpoint to resume: load model weights from this DCP (e.g. seed step-0) or HF safetensors folder."""
    initial_load_model_only: bool = True
    """With initial_load_path a DCP checkpoint: false loads it as a resume (optimizer, LR schedule, data position and
    step too, but what exclude_from_loading names), to go on from another job's checkpoint."""
    create_seed_checkpoint: bool = False
    """On 1 rank: write the initialized model as <folder>/step-0 and exit; loadable at any layout."""
    export_hf: bool = False
    """At the last step, also write the model in Hugging Face's Llama safetensors layout to <folder>/hf."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the Hugging Face export: float32, bfloat16 or float16."""
    enable_first_step_checkpoint: bool = False
    """Also save after step 1: a new cluster or storage shows at once that checkpoints work."""
    load_only: bool = False
    """Resume or load as usual, but save no checkpoint (verification and debugging runs)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "memory_budget"] = "none"
    """Recompute activations in backward: none, full (every block), selective, or memory_budget (compile chooses)."""
    selective_ac_option: str = "2"
    """Selective mode: N (every N-th block; torchtitan's default 2) or 'op' (every block, saving heavy ops' outputs)."""
    memory_budget: float = 0.5
    """For memory_budget mode: the activations kept for backward, from 0 (as full checkpointing) to 1 (as none)."""
    early_stop: bool = True
    """Stop recomputing a block once backward has all it needs (torch's default; torchtitan's: false); same numbers."""
    preserve_rng_state: bool = False
    """Restore the RNG state before recomputing, so random ops redraw the same (torchtitan: true; Llama draws none)."""
    determinism_check: Literal["default", "none"] = "default"
    """Check that recomputed tensors have the first forward's shapes, dtypes and devices ('default') or not ('none')."""
    debug: bool = False
    """Record the ops a block runs and recomputes, shown when the check above fails (slower)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile what compile.components names."""
    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """Compiled by compile.enable: the model (per block for fsdp2, whole for simple_fsdp) and the loss (not with TP)."""
    backend: Literal["inductor", "aot_eager"] = "inductor"
    """torch.compile backend: inductor or aot_eager."""
    bucketing: Literal["none", "manual", "auto", "block"] = "manual"
    """SimpleFSDP's bucketing, model compiled whole: none (per parameter), manual (manual_buckets), auto (cost-model
    buckets of blocks); or block: blocks compiled alone, attention and feed-forward a bucket each, the rest eager."""
    manual_buckets: list[str] = field(default_factory=list)
    """Buckets: '+'-joined module patterns ('layers.0+layers.1'); empty = one per block, tok_embeddings, norm+output."""
    bucket_memory_cap_mb: float = 1024.0
    """Auto bucketing: most megabytes of gathered weights that two neighbouring buckets may hold."""
    compute_flops: float | None = None
    """Auto bucketing: FLOP/s of one rank; unset = measured at start on a block's forward and backward."""

    @property
    def compiles_model(self) -> bool:
        return self.enable and "model" in self.components

    @property
    def compiles_loss(self) -> bool:
        return self.enable and "loss" in self.components


@dataclass
class Float8:
    """Float8 training (model.converters = ["float8"]), torchtitan's [quantize.linear.float8]."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """Scaling into float8: per tensor, per row, or per row with the weight gradient's matmul in high precision."""
    enable_fsdp_float8_all_gather: bool = False
    """FSDP2 gathers the weights already cast to float8 (half the bytes of bf16); tensorwise only."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With the float8 all-gather: all weights' scales computed once after each step, not per gather."""
    filter_fqns: list[str] = field(default_factory=list)
    """Linear layers left in high precision: names containing one of these (e.g. 'output'); 'auto_filter_small_kn'
    adds those torchao finds too small to gain on H100s (tensorwise, rowwise). Dims not divisible by 16 always are."""
    emulate: bool = False
    """Float8 matmuls in high precision on float8-rounded values, for GPUs below compute capability 8.9."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (and at the first and last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files under <dump_folder>/<save_tb_folder>/<run_name>."""
    save_tb_folder: str = "tb"
    """TensorBoard folder inside the dump folder."""
    save_for_all_ranks: bool = False
    """Every rank writes TensorBoard, to <run_name>/rank_<rank> (its own memory, tokens/s and
    TFLOPs; the loss, gradient norm and learning rate are the job's); else rank 0 alone."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; unset = known GPU table or a CPU matmul benchmark."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (wandb package): a run named as TensorBoard's (per rank with save_for_all_ranks),
    project WANDB_PROJECT (default tessera), files in <dump_folder>/wandb; WANDB_MODE=offline for `wandb sync`."""
    straggler_threshold: float = 0
    """Name in each log the ranks busy (not waiting on peers) over this many times their peers' median; 0 = off."""


@dataclass
class Comm:
    alpha_us: float | None = None
    """Collective latency (microseconds) for the auto bucket planner; unset = calibrated at start, as bandwidth_gbps."""
    bandwidth_gbps: float | None = None
    """Collective bandwidth in GB/s (bytes, not bits) for the auto bucket planner; unset = calibrated."""
    init_timeout_seconds: int = 300
    """Timeout of collectives during initialization (first step included)."""
    train_timeout_seconds: int = 100
    """Timeout of collectives once training runs; a hung rank ends the job with an error."""
    hang_timeout_seconds: int = 0
    """Under torchrun, from the second step: a rank silent or in one phase of a step this long is named (rank 0's
    console, <dump_folder>/hangs.log) and the job ends for torchrun to restart it; 0 = off."""
    trace_buf_size: int = 20000
    """Collectives torch's flight recorder keeps per rank (0: none). A rank whose collective fails or times out
    writes them to <dump_folder>/<save_traces_folder>: fr_trace tells which collective each rank was in."""
    save_traces_folder: str = "comm_traces"
    """Folder in the dump folder for the flight recorder's files."""
    save_traces_file_prefix: str = "rank_"
    """The flight recorder's file of a rank is this prefix and the rank."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces."""
    save_traces_folder: str = "profile_traces"
    """Trace folder inside the dump folder."""
    profile_freq: int = 10
    """Record a trace every this many steps."""
    profiler_active: int = 1
    """Steps each trace records: the last ones of every profile_freq window."""
    profiler_warmup: int = 3
    """Steps run unrecorded before them, the profiler's start-up out of the trace (fewer if profile_freq is small)."""
    enable_memory_snapshot: bool = False
    """Record the GPU allocator's history and save a snapshot (pytorch.org/memory_viz) every profile_freq steps and
    on running out of memory (iteration_<step>_exit). CUDA and XPU only (on CPU: a warning)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder inside the dump folder: iteration_<step>/rank<rank>_memory_snapshot.pickle."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on a held-out dataset."""
    dataset: str = "python_docs"
    """Validation corpus, same forms as training.dataset: held-out files, or a hub dataset's split."""
    dataset_config: str = ""
    """Configuration (subset) of a hub validation dataset; empty = its default."""
    dataset_split: str = "validation"
    """Split of a hub validation dataset; local files are read whole."""
    dataset_text_field: str = "text"
    """The record field holding a document's text in the validation corpus."""
    freq: int = 10
    """Validate every this many steps."""
    steps: int = 4
    """Batches per validation."""
    local_batch_size: int | None = None
    """Sequences per rank in a validation batch; unset = training.local_batch_size."""
    seq_len: int | None = None
    """Tokens per validation sequence, at most training.seq_len; unset = training.seq_len."""


Failure = Literal[
    "kill", "hang", "stop", "slow", "kill_during_save", "hang_during_save", "disk_full_during_save", "nan", "oom"
]


@dataclass
class Debug:
    seed: int = 0
    """Seed of model initialization and data order."""
    deterministic: bool = False
    """Use deterministic algorithms so two runs give bitwise-equal losses."""
    deterministic_warn_only: bool = False
    """With deterministic: warn about an operation without a deterministic kernel instead of failing."""
    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic collection is off); 0 = leave gc alone."""
    gc_debug: bool = False
    """Collect garbage fully every step instead, warning of the tensors reference cycles held (count, bytes); slow."""
    fail_at_step: int = -1
    """Failure injection for tests, first attempt only: at this step the last rank does debug.failure; -1 = never."""
    failure: Failure = "kill"
    """What debug.fail_at_step injects: kill (SIGKILL), hang (sleep forever), stop (SIGSTOP, 1 s into the step), slow
    (0.5 s more in each step from then on), kill_during_save or hang_during_save (in that step's save),
    disk_full_during_save (ENOSPC there), nan (non-finite gradients) or oom (that rank alone)."""


@dataclass
class MemoryEstimation:
    """torchtitan's [memory_estimation]: the dry run's estimate before training."""

    enable: bool = False
    """run_train.sh first runs the dry run (COMM_MODE=fake) at the job's world size and prints its memory
    estimate, then trains."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    plan: Plan = field(default_factory=Plan)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    generation: Generation = field(default_factory=Generation)
    eval: Evaluation = field(default_factory=Evaluation)

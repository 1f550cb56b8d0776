"""Episodes (rollout): the task data, the task suites (tasks/), sandboxes (envs/), the judge and the
agent that runs each episode."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from arborl.config.base import Section


class DataConfig(Section):
    """The `dataset` task suite: prompts from JSONL / Parquet files, scored by your reward function."""

    train_files: list[str] = Field(
        default_factory=list,
        description="JSONL (.jsonl, .json) or Parquet (.parquet) files of training prompts, one row per task, read "
        "with Hugging Face datasets (a relative path in a config file is that file's folder's, one given with "
        "--set the working directory's; on the command line one file or a list: --set 'rollout.data.train_files=[a.jsonl,b.jsonl]')",
    )
    eval_files: list[str] = Field(
        default_factory=list,
        description="held-out files in the same format; evaluation takes rollout.eval_tasks of their rows, chosen "
        "by eval_sample (rollout.task=dataset needs them when rollout.eval_tasks > 0)",
    )
    eval_sample: Literal["first", "random", "stratified"] = Field(
        "first",
        description="which eval rows are evaluated: first = the first rollout.eval_tasks rows; random = a sample "
        "seeded by eval_seed; stratified = from each value of the eval_stratify_key column its share of the rows "
        "(at least one each while rollout.eval_tasks allows), sampled with eval_seed. The same rows before and after "
        "training",
    )
    eval_seed: int = Field(0, description="seed of eval_sample=random / stratified")
    eval_stratify_key: str | None = Field(
        None, description="column whose values are the strata of eval_sample=stratified (e.g. the source of each row)"
    )
    prompt_key: str = Field(
        "prompt",
        description="column holding the prompt: a string (one user message) or a list of chat messages "
        "({role, content})",
    )
    answer_key: str | None = Field(
        "answer",
        description="column passed to the reward function as `answer` (null = the data has no answer column, "
        "the reward function gets None); every column but the prompt is also in task.metadata",
    )
    system_prompt: str | None = Field(
        None, description="system message put before every prompt (None = only what the data holds)"
    )
    reward_function: str = Field(
        "exact_match",
        description="scores an episode: exact_match (1.0 when the stripped reply equals str(answer)) or a path "
        "to your own, package.module:attr or path/to/file.py:attr, called as (task, completion, calls, answer) "
        "-> float or dict of reward components holding \"outcome\" (reward units)",
    )

    @model_validator(mode="after")
    def _strata_named(self) -> "DataConfig":
        if self.eval_sample == "stratified" and not self.eval_stratify_key:
            raise ValueError("eval_sample=stratified needs eval_stratify_key, the column whose values are the strata "
                             "(e.g. the source of each row)")
        return self


class CodeRepairConfig(Section):
    """The code_repair task suite: generated buggy repositories with hidden tests (tasks/code_repair)."""

    tier: Literal["easy", "medium", "hard", "all"] = Field(
        "all",
        description="which tasks are drawn: easy (one file; the statement names the function and failing tests), "
        "medium (a package, the bug away from the entry point), hard (the statement gives only the symptom), or all",
    )
    seed: int = Field(0, description="generator seed: which repositories, bugs and names the suite holds")
    per_template: int = Field(16, ge=1, description="tasks generated per bug template (25 templates; tasks)")
    suite_dir: str = Field(
        "",
        description="directory the suite is materialised into on first use, with its validation cache "
        "('' = ~/.cache/arborl/code_repair/v<generator>-seed<seed>-n<per_template>)",
    )
    variants: bool = Field(
        False, description="also train on the perturbed variants of the train tasks (renamed, reordered, reworded, "
        "moved, optional dependency removed; E5), each validated on its own; the held-out tasks' variants are only "
        "ever the eval_perturbed split, never eval"
    )
    require_validated: bool = Field(
        True,
        description="draw only tasks whose validation passed (`arborl envs validate code_repair`); false = also "
        "tasks never validated (never those that failed)",
    )
    validation_k: int = Field(3, ge=1, description="runs of the gold patch and of the no-op per task when validating; all must agree (runs)")
    test_timeout_s: float = Field(60.0, gt=0, description="wall-clock limit of one run of a task's hidden tests (seconds)")
    eval_perturbed: bool = Field(
        False, description="also evaluate on the perturbed variants of the held-out tasks (split eval_perturbed, E5)")


class JudgeConfig(Section):
    """E4: an LLM judge of finished episodes against reward hacks (tasks/judge.py), for suites that offer
    it (code_repair); its verdict and reasoning are stored with the episode (meta "judge")."""

    mode: Literal["off", "veto", "weight"] = Field(
        "off",
        description="off; veto = an episode the judge calls a hack scores outcome 0; weight = outcome becomes "
        "(1 - weight) x outcome + weight x judge score where the tests passed",
    )
    weight: float = Field(0.5, ge=0, le=1, description="the judge's share of the outcome when mode=weight")
    base_url: str | None = Field(
        None, description="OpenAI-compatible endpoint of the judge (.../v1); None = the served policy, in judge "
        "sessions that are never trained on",
    )
    model: str | None = Field(None, description="model name sent to base_url (None = the served model's name)")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding base_url's API key")
    max_tokens: int = Field(256, ge=1, description="most tokens of the judge's answer")


class GymConfig(Section):
    """The gym task suite: a Gymnasium-style text environment (tasks/gym_env.py)."""

    env: str = Field(
        "",
        description="the environment: package.module:attr or path/to/file.py:attr naming a class or factory that "
        "returns a new environment per episode; accepted: gymnasium.Env and GEM's gem.Env (reset(seed) -> "
        "(observation, info), step(text) -> (observation, reward, terminated, truncated, info)), SkyRL-Gym's "
        "BaseTextEnv (init(prompt) -> (messages, info), step(text) -> {observations, reward, done, metadata}), or "
        "any object with the same methods. rollout.task=gym needs it",
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of every env construction (a SkyRL-Gym env gets them as env_config, and "
        "each data row's columns other than the prompt as extras)",
    )
    system_prompt: str | None = Field(None, description="system message before the environment's first observation")
    eval_seed: int = Field(
        1_000_000_000,
        ge=0,
        description="reset seeds of held-out episodes (Gymnasium convention) are eval_seed, eval_seed + 1, ...: the "
        "same every evaluation; training draws seeds below it, so the splits are disjoint",
    )


class HarborConfig(Section):
    """The harbor task suite: Harbor / terminal-bench task folders run in the sandbox (tasks/harbor)."""

    tasks_dir: str = Field(
        "",
        description="directory of Harbor task folders (each with task.toml, instruction.md, environment/, tests/, "
        "solution/); rollout.task=harbor needs it",
    )
    eval_fraction: float = Field(
        0.34, ge=0, le=1,
        description="share of the tasks held out for evaluation, chosen by a hash of each task's name (a task's "
        "task.toml [metadata] split = \"train\" / \"eval\" overrides it)",
    )
    host_images: list[str] = Field(
        default_factory=lambda: ["python", "debian", "ubuntu", "buildpack-deps"],
        description="base images (environment/Dockerfile FROM, task.toml docker_image) the sandbox stands in for "
        "with this host's own system and Python; a task built from another image, or whose Dockerfile RUNs "
        "commands, is refused with its reason (listed by arborl envs validate harbor)",
    )
    verifier_timeout_s: float = Field(
        120.0, gt=0, description="most seconds tests/test.sh may run (a task's [verifier] timeout_sec, if lower, wins)"
    )


class VerifiersConfig(Section):
    """The verifiers task suite: a verifiers (0.4, verifiers.v1) environment (tasks/verifiers_env.py)."""

    env: str = Field(
        "",
        description="the environment: an installed module's id (exporting one verifiers Taskset, and optionally its "
        "Env) or path/to/env.py[:Attr]; rollout.task=verifiers needs it",
    )
    python: str | None = Field(
        None,
        description="the interpreter that has verifiers installed and runs the environment (`make verifiers` makes "
        ".venv-vf/bin/python); None = the one running arborl",
    )
    eval_fraction: float = Field(
        0.2, ge=0, lt=1,
        description="share of the taskset held out for evaluation, chosen by a hash of each task's key (the same "
        "split every run)",
    )
    list_timeout_s: float = Field(300.0, gt=0, description="most seconds listing the taskset may take at start")


class EnvsConfig(Section):
    """Environments: the sandbox runtime agent commands run in, its workspaces and its limits (docs/envs.md)."""

    runtime: str = Field(
        "bwrap",
        description="bwrap (bubblewrap sandbox; errors where it cannot run), local (NO isolation: an explicit, "
        "unsafe opt-in), or module:attr / file.py:attr of your own runtime class",
    )
    root_dir: str = Field("/tmp/arborl-envs", description="directory holding the episodes' workspaces, one per episode id")
    copy_mode: Literal["copy", "cp"] = Field(
        "copy",
        description="how a workspace is made from its template: copy (in-process file copy) or cp (`cp -a "
        "--reflink=auto`, copy-on-write where the filesystem supports it); never hard links",
    )
    wall_s: float = Field(30.0, gt=0, description="wall-clock limit of one command (seconds); its whole process tree is killed")
    cpu_s: int = Field(30, ge=1, description="CPU-time limit of one command's processes (seconds, RLIMIT_CPU)")
    memory_mb: int = Field(2048, ge=16, description="address-space limit per process (MiB, RLIMIT_AS)")
    processes: int = Field(64, ge=4, description="most processes/threads one workspace's commands may have at once (bwrap as root: all its commands "
        "together, on the workspace's uid; as another user: each command, in its own user namespace; not set by the "
        "local runtime)")
    file_size_mb: int = Field(64, ge=1, description="largest file a command may write (MiB, RLIMIT_FSIZE)")
    disk_mb: int = Field(256, ge=1, description="most bytes a workspace may hold (MiB; a size-capped tmpfs when root)")
    tmp_mb: int = Field(64, ge=1, description="size of the sandbox's private /tmp (MiB, tmpfs)")
    output_kb: int = Field(
        4096, ge=1, description="most stdout+stderr kept from one command (KiB); past it the command is killed"
    )
    workspace_path: str = Field("/workspace", description="where the workspace appears inside the sandbox (its cwd)")
    bind_python: bool = Field(
        True,
        description="bind the running Python (its venv and base installation) read-only into the sandbox and put it "
        "first on PATH, so `python -m pytest` works inside",
    )
    ro_binds: list[str] = Field(
        default_factory=list, description="extra host paths bound read-only into the sandbox at their absolute path "
        "(relative ones are the config file's folder's, or with --set the working directory's), e.g. the directory of a sandboxed agent command's script"
    )
    sandbox_uid_base: int = Field(
        61000,
        ge=1000,
        description="as root, each live workspace runs as its own unprivileged uid from [base, base + sandbox_uids) "
        "so the process cap binds (RLIMIT_NPROC does not bind root)",
    )
    sandbox_uids: int = Field(1024, ge=1, description="size of that uid pool (the most workspaces live at once, as root)")
    sandbox_wait_s: float = Field(
        300.0,
        ge=0,
        description="how long a workspace or command waits in the runtime's queue for the host (a free sandbox uid, "
        "processes, file descriptors, memory) before its start is an infrastructure failure (seconds; 0 = fail at once)",
    )
    bwrap_path: str = Field("bwrap", description="the bubblewrap executable (a name looked up on PATH, or a path)")
    seccomp: bool = Field(
        True,
        description="bwrap: run every command under the syscall filter of envs/seccomp.py (Docker's default list: "
        "keyrings, ptrace, mount, new namespaces, bpf, io_uring, ... fail with EPERM); false only where libseccomp "
        "cannot be installed, knowing sandboxed commands then reach those calls (docs/envs.md)",
    )


class RolloutConfig(Section):
    """The rollout controller: which tasks, how many per step, how episodes are sampled."""

    task: str = Field(
        "calculator",
        description="task suite (registry tasks.TASK_SUITES): calculator, arith, even_tokens, dataset (prompts from rollout.data), chain (max_turns - 1 dependent tool calls, a wrong step ends the episode), chain_tokens (the same on token ids, max_turns steps, tiny models), code_repair (fix a bug in a small repository, hidden tests; rollout.code_repair), gym (a Gymnasium / GEM / SkyRL-Gym text environment; rollout.gym), harbor (Harbor task folders in the sandbox; rollout.harbor), verifiers (a verifiers environment; rollout.verifiers); or a path to your own, package.module:attr or path/to/file.py:attr naming a "
        "factory of the rollout section",
    )
    agent: str = Field(
        "suite",
        description="agent of every episode (registry agents.AGENTS): suite = the task suite's own agent; command = the black-box program rollout.agent_command; or a path to your own, package.module:attr or path/to/file.py:attr "
        "naming a factory (suite, sampling) -> agent loop",
    )
    steps: int = Field(10, ge=0, description="training steps (one optimiser step each)")
    batch_tasks: int = Field(8, ge=1, description="tasks per step (B)")
    group_size: int = Field(4, ge=1, description="episodes per task per step (G), the GRPO group")
    temperature: float = Field(
        0.7,
        gt=0,
        description="sampling temperature of training episodes; the trainer optimises softmax(logits / T), the "
        "policy the episodes were drawn from",
    )
    top_p: float = Field(
        1.0, gt=0, le=1,
        description="nucleus sampling of training episodes (< 1 makes the rollout distribution differ from the "
        "trainer's; the correction metrics show by how much)",
    )
    max_tokens: int = Field(48, ge=1, description="completion tokens per model call")
    max_turns: int = Field(3, ge=1, description="model calls per episode (tool rounds + final answer)")
    in_context_example: bool = Field(True, description="calculator: put one worked example in the prompt")
    agent_timeout_s: float = Field(600.0, gt=0, description="an episode running longer is aborted (seconds)")
    trust_agent_rewards: bool = Field(
        False,
        description="let an agent program post process rewards on its own session with its session key (POST "
        "/v1/sessions/{id}/reward); off: only the harness (white-box loops, rollout workers, the task's scorer: "
        "the session's harness key or the admin key) can, so a black-box or sandboxed agent cannot reward itself",
    )
    eval_tasks: int = Field(64, ge=0, description="held-out tasks evaluated before and after training (0 = skip)")
    eval_temperature: float = Field(0.0, ge=0, description="sampling temperature of evaluation (0 = greedy)")
    eval_every: int = Field(0, ge=0, description="also evaluate every N steps (0 = only before and after)")
    checkpoint_every: int = Field(0, ge=0, description="save a checkpoint every N steps (0 = only at the end)")
    max_idle_steps: int = Field(
        5,
        ge=0,
        description="stop the run, with a checkpoint and an explanation, after this many consecutive steps that "
        "trained nothing (every group zero-variance or unusable) (steps; 0 = never stop, only warn)",
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="prompt files and reward function of the dataset task suite"
    )
    code_repair: CodeRepairConfig = Field(
        default_factory=CodeRepairConfig, description="tiers, cache and validation of the code_repair task suite"
    )
    harbor: HarborConfig = Field(
        default_factory=HarborConfig, description="the task folders of the harbor task suite (Harbor / terminal-bench format)"
    )
    verifiers: VerifiersConfig = Field(
        default_factory=VerifiersConfig, description="the environment of the verifiers task suite and its interpreter"
    )
    gym: GymConfig = Field(
        default_factory=GymConfig,
        description="the environment of the gym task suite (Gymnasium / GEM / SkyRL-Gym text environments; "
        "environments that take a prompt read their rows from rollout.data.train_files / eval_files)",
    )
    agent_command: list[str] = Field(
        default_factory=list,
        description="argv of the black-box program rollout.agent=command runs once per episode, e.g. "
        "[python, my_agent.py]; it gets OPENAI_BASE_URL / OPENAI_API_KEY of the episode's session",
    )
    process_penalties: bool = Field(
        False,
        description="calculator: post Forge's process penalties (C1: -0.2 for a malformed tool call, a tool error, "
        "language mixing) as process rewards on their turns. Off by default: on a sparse-outcome task, penalties "
        "alone teach the policy to stop calling the tool (measured: the default job's training reward stayed 0 and "
        "its steps stopped training). The chain task always emits its step rewards",
    )
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="LLM judge of finished episodes (E4)")
    envs: EnvsConfig = Field(
        default_factory=EnvsConfig, description="sandboxed environments the episodes run in: runtime, workspaces, limits"
    )
    workers: int = Field(
        0,
        ge=0,
        description="rollout worker processes that run the episodes (agent + environment) and reach the gateway "
        "over HTTP, so a crashing or hanging agent never blocks the controller or another episode (A4); "
        "0 = episodes run in the controller's own process",
    )
    infra_retries: int = Field(
        2,
        ge=0,
        description="times an episode that failed for an infrastructure reason (its worker died, its sandbox did "
        "not start, the gateway answered 5xx) is run again; infrastructure failures are never trained on",
    )
    worker_stall_s: float = Field(
        30.0, gt=0, description="a rollout worker that sends no heartbeat for this long is killed and restarted (seconds)"
    )

    @model_validator(mode="after")
    def _command_agent(self) -> "RolloutConfig":
        if self.agent == "command" and not self.agent_command:
            raise ValueError("agent=command needs agent_command, the program's argv, e.g. [python, my_agent.py]")
        return self

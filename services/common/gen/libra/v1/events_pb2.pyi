from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TurnRequest(_message.Message):
    __slots__ = ("request_id", "trajectory_id", "turn_index", "engine_id", "bucket", "context_token_ids", "max_new_tokens", "temperature", "min_policy_version", "stop", "priority", "min_new_tokens", "top_p", "group_id", "prompt_id", "seq", "sampling_seed", "context_offset", "context_digest", "stream", "alternatives", "alternatives_prompt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_PROMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    trajectory_id: str
    turn_index: int
    engine_id: str
    bucket: str
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    temperature: float
    min_policy_version: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    priority: int
    min_new_tokens: int
    top_p: float
    group_id: str
    prompt_id: str
    seq: int
    sampling_seed: int
    context_offset: int
    context_digest: int
    stream: bool
    alternatives: int
    alternatives_prompt: int
    def __init__(self, request_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., turn_index: _Optional[int] = ..., engine_id: _Optional[str] = ..., bucket: _Optional[str] = ..., context_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., min_policy_version: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., priority: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., top_p: _Optional[float] = ..., group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., seq: _Optional[int] = ..., sampling_seed: _Optional[int] = ..., context_offset: _Optional[int] = ..., context_digest: _Optional[int] = ..., stream: bool = ..., alternatives: _Optional[int] = ..., alternatives_prompt: _Optional[int] = ...) -> None: ...

class TurnProgress(_message.Message):
    __slots__ = ("request_id", "trajectory_id", "engine_id", "offset", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    trajectory_id: str
    engine_id: str
    offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TurnResult(_message.Message):
    __slots__ = ("request_id", "trajectory_id", "turn_index", "engine_id", "token_ids", "logprobs", "policy_version", "finish_reason", "context_tokens", "queue_s", "generate_s", "text", "error", "token_versions", "temperature", "drafted_tokens", "accepted_tokens", "alternatives")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    trajectory_id: str
    turn_index: int
    engine_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    finish_reason: str
    context_tokens: int
    queue_s: float
    generate_s: float
    text: str
    error: ErrorInfo
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    drafted_tokens: int
    accepted_tokens: int
    alternatives: _containers.RepeatedCompositeFieldContainer[Alternative]
    def __init__(self, request_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., turn_index: _Optional[int] = ..., engine_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ..., finish_reason: _Optional[str] = ..., context_tokens: _Optional[int] = ..., queue_s: _Optional[float] = ..., generate_s: _Optional[float] = ..., text: _Optional[str] = ..., error: _Optional[_Union[ErrorInfo, _Mapping]] = ..., token_versions: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., alternatives: _Optional[_Iterable[_Union[Alternative, _Mapping]]] = ...) -> None: ...

class Alternative(_message.Message):
    __slots__ = ("token_ids", "logprobs", "token_versions", "finish_reason", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("call_id", "trajectory_id", "tool", "args_json", "timeout_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    trajectory_id: str
    tool: str
    args_json: str
    timeout_s: float
    def __init__(self, call_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., tool: _Optional[str] = ..., args_json: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ToolReturn(_message.Message):
    __slots__ = ("call_id", "trajectory_id", "tool", "status", "payload", "payload_bytes", "size_class", "wall_s", "cpu_s", "peak_rss_bytes", "truncated", "exit_code", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_CLASS_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    trajectory_id: str
    tool: str
    status: str
    payload: str
    payload_bytes: int
    size_class: str
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int
    truncated: bool
    exit_code: int
    error: str
    def __init__(self, call_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., tool: _Optional[str] = ..., status: _Optional[str] = ..., payload: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., size_class: _Optional[str] = ..., wall_s: _Optional[float] = ..., cpu_s: _Optional[float] = ..., peak_rss_bytes: _Optional[int] = ..., truncated: bool = ..., exit_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class AgentRun(_message.Message):
    __slots__ = ("trajectory_id", "sample_json", "api_key", "base_url", "timeout_s")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_JSON_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    sample_json: str
    api_key: str
    base_url: str
    timeout_s: float
    def __init__(self, trajectory_id: _Optional[str] = ..., sample_json: _Optional[str] = ..., api_key: _Optional[str] = ..., base_url: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AgentRunAccepted(_message.Message):
    __slots__ = ("trajectory_id", "worker_id", "refused")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    worker_id: str
    refused: str
    def __init__(self, trajectory_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., refused: _Optional[str] = ...) -> None: ...

class AgentCancel(_message.Message):
    __slots__ = ("trajectory_id", "sandbox_id")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    sandbox_id: str
    def __init__(self, trajectory_id: _Optional[str] = ..., sandbox_id: _Optional[str] = ...) -> None: ...

class AgentReturn(_message.Message):
    __slots__ = ("trajectory_id", "answer_json", "failure", "message", "wall_s", "cpu_s", "peak_rss_bytes", "worker_id")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWER_JSON_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    answer_json: str
    failure: str
    message: str
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int
    worker_id: str
    def __init__(self, trajectory_id: _Optional[str] = ..., answer_json: _Optional[str] = ..., failure: _Optional[str] = ..., message: _Optional[str] = ..., wall_s: _Optional[float] = ..., cpu_s: _Optional[float] = ..., peak_rss_bytes: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("token_ids", "logprobs", "generated", "policy_version", "temperature", "starts_sequence")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    STARTS_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    generated: bool
    policy_version: int
    temperature: float
    starts_sequence: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., generated: bool = ..., policy_version: _Optional[int] = ..., temperature: _Optional[float] = ..., starts_sequence: bool = ...) -> None: ...

class TrajectorySample(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "prompt_id", "transcript_json")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_JSON_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    prompt_id: str
    transcript_json: str
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., transcript_json: _Optional[str] = ...) -> None: ...

class CompletedTrajectory(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "sample_index", "group_size", "prompt_id", "segments", "reward", "num_turns", "min_policy_version", "max_policy_version", "tool_statuses", "finish", "latency_s", "final_text", "failure", "breakdown", "truncated", "overlong_penalty", "completed_at")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOOL_STATUSES_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    FINAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_PENALTY_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    sample_index: int
    group_size: int
    prompt_id: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    reward: float
    num_turns: int
    min_policy_version: int
    max_policy_version: int
    tool_statuses: _containers.RepeatedScalarFieldContainer[str]
    finish: str
    latency_s: float
    final_text: str
    failure: ErrorInfo
    breakdown: LatencyBreakdown
    truncated: bool
    overlong_penalty: float
    completed_at: float
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., group_size: _Optional[int] = ..., prompt_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., reward: _Optional[float] = ..., num_turns: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., tool_statuses: _Optional[_Iterable[str]] = ..., finish: _Optional[str] = ..., latency_s: _Optional[float] = ..., final_text: _Optional[str] = ..., failure: _Optional[_Union[ErrorInfo, _Mapping]] = ..., breakdown: _Optional[_Union[LatencyBreakdown, _Mapping]] = ..., truncated: bool = ..., overlong_penalty: _Optional[float] = ..., completed_at: _Optional[float] = ...) -> None: ...

class LatencyBreakdown(_message.Message):
    __slots__ = ("scheduler_queue_s", "engine_queue_s", "generate_s", "tool_s")
    SCHEDULER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_S_FIELD_NUMBER: _ClassVar[int]
    scheduler_queue_s: float
    engine_queue_s: float
    generate_s: float
    tool_s: float
    def __init__(self, scheduler_queue_s: _Optional[float] = ..., engine_queue_s: _Optional[float] = ..., generate_s: _Optional[float] = ..., tool_s: _Optional[float] = ...) -> None: ...

class GroupOutcome(_message.Message):
    __slots__ = ("group_id", "outcome", "reason", "trajectories", "weight_version", "train_step", "trained_ids")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINED_IDS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    outcome: str
    reason: str
    trajectories: int
    weight_version: int
    train_step: int
    trained_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_id: _Optional[str] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., trajectories: _Optional[int] = ..., weight_version: _Optional[int] = ..., train_step: _Optional[int] = ..., trained_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("engine_id", "bucket", "running", "waiting", "tokens_per_s", "weight_version", "weight_sync_addr", "request_ids", "tensor_parallel", "capacity_seqs", "free_kv_tokens", "backend", "spec_verify_steps", "spec_drafted_tokens", "spec_accepted_tokens", "last_seq", "answered_ids")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_ADDR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_SEQS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    bucket: str
    running: int
    waiting: int
    tokens_per_s: float
    weight_version: int
    weight_sync_addr: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel: int
    capacity_seqs: int
    free_kv_tokens: int
    backend: str
    spec_verify_steps: int
    spec_drafted_tokens: int
    spec_accepted_tokens: int
    last_seq: int
    answered_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., bucket: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., weight_version: _Optional[int] = ..., weight_sync_addr: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., tensor_parallel: _Optional[int] = ..., capacity_seqs: _Optional[int] = ..., free_kv_tokens: _Optional[int] = ..., backend: _Optional[str] = ..., spec_verify_steps: _Optional[int] = ..., spec_drafted_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., last_seq: _Optional[int] = ..., answered_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerHello(_message.Message):
    __slots__ = ("worker_id", "kind", "weight_sync_addr", "tensor_parallel", "preferred_bucket", "trainer_engine")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_ADDR_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_BUCKET_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ENGINE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kind: str
    weight_sync_addr: str
    tensor_parallel: int
    preferred_bucket: str
    trainer_engine: bool
    def __init__(self, worker_id: _Optional[str] = ..., kind: _Optional[str] = ..., weight_sync_addr: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., preferred_bucket: _Optional[str] = ..., trainer_engine: bool = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("worker_id", "role", "bucket", "fencing_token", "weight_sync_addr", "tensor_parallel")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_ADDR_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    bucket: str
    fencing_token: int
    weight_sync_addr: str
    tensor_parallel: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., bucket: _Optional[str] = ..., fencing_token: _Optional[int] = ..., weight_sync_addr: _Optional[str] = ..., tensor_parallel: _Optional[int] = ...) -> None: ...

class BucketSpec(_message.Message):
    __slots__ = ("name", "tensor_parallel", "max_context_tokens", "max_output_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor_parallel: int
    max_context_tokens: int
    max_output_tokens: int
    def __init__(self, name: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("plan_version", "assignments", "reason", "lease_ttl_s", "buckets", "planner_epoch", "predicted_gain")
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PLANNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GAIN_FIELD_NUMBER: _ClassVar[int]
    plan_version: int
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    reason: str
    lease_ttl_s: float
    buckets: _containers.RepeatedCompositeFieldContainer[BucketSpec]
    planner_epoch: int
    predicted_gain: float
    def __init__(self, plan_version: _Optional[int] = ..., assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., reason: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., buckets: _Optional[_Iterable[_Union[BucketSpec, _Mapping]]] = ..., planner_epoch: _Optional[int] = ..., predicted_gain: _Optional[float] = ...) -> None: ...

class LengthQuantiles(_message.Message):
    __slots__ = ("count", "p50", "p90", "p99", "max")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    count: int
    p50: float
    p90: float
    p99: float
    max: float
    def __init__(self, count: _Optional[int] = ..., p50: _Optional[float] = ..., p90: _Optional[float] = ..., p99: _Optional[float] = ..., max: _Optional[float] = ...) -> None: ...

class WorkloadStats(_message.Message):
    __slots__ = ("window_s", "new_tokens_per_turn", "context_tokens_per_turn", "turns_per_trajectory", "trajectory_latency_s", "queued_turns_by_bucket", "tool_returns_by_status", "trajectories_per_s", "trained_version", "trajectory_output_tokens", "tool_s_per_turn", "prompt_tokens", "turns_per_trajectory_mean", "running_turns_by_bucket", "running_output_tokens")
    class QueuedTurnsByBucketEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ToolReturnsByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RunningTurnsByBucketEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    TURNS_PER_TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TURNS_BY_BUCKET_FIELD_NUMBER: _ClassVar[int]
    TOOL_RETURNS_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRAINED_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_S_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURNS_PER_TRAJECTORY_MEAN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TURNS_BY_BUCKET_FIELD_NUMBER: _ClassVar[int]
    RUNNING_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    new_tokens_per_turn: LengthQuantiles
    context_tokens_per_turn: LengthQuantiles
    turns_per_trajectory: LengthQuantiles
    trajectory_latency_s: LengthQuantiles
    queued_turns_by_bucket: _containers.ScalarMap[str, int]
    tool_returns_by_status: _containers.ScalarMap[str, int]
    trajectories_per_s: float
    trained_version: int
    trajectory_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    tool_s_per_turn: float
    prompt_tokens: float
    turns_per_trajectory_mean: float
    running_turns_by_bucket: _containers.ScalarMap[str, int]
    running_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, window_s: _Optional[float] = ..., new_tokens_per_turn: _Optional[_Union[LengthQuantiles, _Mapping]] = ..., context_tokens_per_turn: _Optional[_Union[LengthQuantiles, _Mapping]] = ..., turns_per_trajectory: _Optional[_Union[LengthQuantiles, _Mapping]] = ..., trajectory_latency_s: _Optional[_Union[LengthQuantiles, _Mapping]] = ..., queued_turns_by_bucket: _Optional[_Mapping[str, int]] = ..., tool_returns_by_status: _Optional[_Mapping[str, int]] = ..., trajectories_per_s: _Optional[float] = ..., trained_version: _Optional[int] = ..., trajectory_output_tokens: _Optional[_Iterable[int]] = ..., tool_s_per_turn: _Optional[float] = ..., prompt_tokens: _Optional[float] = ..., turns_per_trajectory_mean: _Optional[float] = ..., running_turns_by_bucket: _Optional[_Mapping[str, int]] = ..., running_output_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class RoleChange(_message.Message):
    __slots__ = ("worker_id", "from_role", "to_role", "bucket", "fencing_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    from_role: str
    to_role: str
    bucket: str
    fencing_token: int
    def __init__(self, worker_id: _Optional[str] = ..., from_role: _Optional[str] = ..., to_role: _Optional[str] = ..., bucket: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class HybridState(_message.Message):
    __slots__ = ("worker_id", "state", "fencing_token", "seconds", "generation", "detail", "turns_handed_back")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TURNS_HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: str
    fencing_token: int
    seconds: float
    generation: int
    detail: str
    turns_handed_back: int
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[str] = ..., fencing_token: _Optional[int] = ..., seconds: _Optional[float] = ..., generation: _Optional[int] = ..., detail: _Optional[str] = ..., turns_handed_back: _Optional[int] = ...) -> None: ...

class LendRequest(_message.Message):
    __slots__ = ("want", "fencing_token", "step")
    WANT_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    want: str
    fencing_token: int
    step: int
    def __init__(self, want: _Optional[str] = ..., fencing_token: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class LendReply(_message.Message):
    __slots__ = ("workers", "plan_version")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedScalarFieldContainer[str]
    plan_version: int
    def __init__(self, workers: _Optional[_Iterable[str]] = ..., plan_version: _Optional[int] = ...) -> None: ...

class HybridGroup(_message.Message):
    __slots__ = ("generation", "store_addr", "members", "member_tokens", "trainer_token", "timeout_s", "rendezvous_key")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDR_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    store_addr: str
    members: _containers.RepeatedScalarFieldContainer[str]
    member_tokens: _containers.RepeatedScalarFieldContainer[int]
    trainer_token: int
    timeout_s: float
    rendezvous_key: str
    def __init__(self, generation: _Optional[int] = ..., store_addr: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., member_tokens: _Optional[_Iterable[int]] = ..., trainer_token: _Optional[int] = ..., timeout_s: _Optional[float] = ..., rendezvous_key: _Optional[str] = ...) -> None: ...

class WeightsUpdated(_message.Message):
    __slots__ = ("version", "checksum", "size_bytes", "push_s", "engines", "train_step", "uploaded_bytes", "delta_bytes", "delta_engines", "dtype", "relayed_engines")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_S_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_ENGINES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RELAYED_ENGINES_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum: str
    size_bytes: int
    push_s: float
    engines: _containers.RepeatedScalarFieldContainer[str]
    train_step: int
    uploaded_bytes: int
    delta_bytes: int
    delta_engines: int
    dtype: str
    relayed_engines: int
    def __init__(self, version: _Optional[int] = ..., checksum: _Optional[str] = ..., size_bytes: _Optional[int] = ..., push_s: _Optional[float] = ..., engines: _Optional[_Iterable[str]] = ..., train_step: _Optional[int] = ..., uploaded_bytes: _Optional[int] = ..., delta_bytes: _Optional[int] = ..., delta_engines: _Optional[int] = ..., dtype: _Optional[str] = ..., relayed_engines: _Optional[int] = ...) -> None: ...

class TrainMetrics(_message.Message):
    __slots__ = ("step", "weight_version", "loss", "reward_mean", "reward_std", "trajectories", "tokens", "step_s", "kl", "clip_fraction", "push_s", "push_bytes", "done", "data_parallel", "groups_ready", "entropy", "is_weight_mean", "is_weight_max", "is_truncated_fraction", "dual_clip_fraction", "logprob_mismatch", "mismatch_tokens", "lr", "grad_norm", "groups_filtered", "policy_versions", "stale_token_fraction", "ref_kl", "sampled_reward_mean", "sampled_reward_std", "sampled_trajectories", "groups_informative", "overlong_filtered", "lends", "reclaims", "seconds_lent", "early_reclaims", "lent_turns_answered")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PUSH_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_READY_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_MAX_FIELD_NUMBER: _ClassVar[int]
    IS_TRUNCATED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DUAL_CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STALE_TOKEN_FRACTION_FIELD_NUMBER: _ClassVar[int]
    REF_KL_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_INFORMATIVE_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_FILTERED_FIELD_NUMBER: _ClassVar[int]
    LENDS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LENT_FIELD_NUMBER: _ClassVar[int]
    EARLY_RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    LENT_TURNS_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    loss: float
    reward_mean: float
    reward_std: float
    trajectories: int
    tokens: int
    step_s: float
    kl: float
    clip_fraction: float
    push_s: float
    push_bytes: int
    done: bool
    data_parallel: int
    groups_ready: int
    entropy: float
    is_weight_mean: float
    is_weight_max: float
    is_truncated_fraction: float
    dual_clip_fraction: float
    logprob_mismatch: float
    mismatch_tokens: int
    lr: float
    grad_norm: float
    groups_filtered: int
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    stale_token_fraction: float
    ref_kl: float
    sampled_reward_mean: float
    sampled_reward_std: float
    sampled_trajectories: int
    groups_informative: int
    overlong_filtered: int
    lends: int
    reclaims: int
    seconds_lent: float
    early_reclaims: int
    lent_turns_answered: int
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., loss: _Optional[float] = ..., reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., trajectories: _Optional[int] = ..., tokens: _Optional[int] = ..., step_s: _Optional[float] = ..., kl: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., push_s: _Optional[float] = ..., push_bytes: _Optional[int] = ..., done: bool = ..., data_parallel: _Optional[int] = ..., groups_ready: _Optional[int] = ..., entropy: _Optional[float] = ..., is_weight_mean: _Optional[float] = ..., is_weight_max: _Optional[float] = ..., is_truncated_fraction: _Optional[float] = ..., dual_clip_fraction: _Optional[float] = ..., logprob_mismatch: _Optional[float] = ..., mismatch_tokens: _Optional[int] = ..., lr: _Optional[float] = ..., grad_norm: _Optional[float] = ..., groups_filtered: _Optional[int] = ..., policy_versions: _Optional[_Iterable[int]] = ..., stale_token_fraction: _Optional[float] = ..., ref_kl: _Optional[float] = ..., sampled_reward_mean: _Optional[float] = ..., sampled_reward_std: _Optional[float] = ..., sampled_trajectories: _Optional[int] = ..., groups_informative: _Optional[int] = ..., overlong_filtered: _Optional[int] = ..., lends: _Optional[int] = ..., reclaims: _Optional[int] = ..., seconds_lent: _Optional[float] = ..., early_reclaims: _Optional[int] = ..., lent_turns_answered: _Optional[int] = ...) -> None: ...

class MetricSample(_message.Message):
    __slots__ = ("service", "worker_id", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    service: str
    worker_id: str
    values: _containers.ScalarMap[str, float]
    def __init__(self, service: _Optional[str] = ..., worker_id: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ErrorInfo(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ErrorEvent(_message.Message):
    __slots__ = ("service", "worker_id", "subject", "error")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    service: str
    worker_id: str
    subject: str
    error: ErrorInfo
    def __init__(self, service: _Optional[str] = ..., worker_id: _Optional[str] = ..., subject: _Optional[str] = ..., error: _Optional[_Union[ErrorInfo, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("trajectories_completed", "trajectories_in_flight", "tool_calls_by_status", "turns", "dropped_stale", "reward_mean", "groups_launched", "groups_total", "trained_version", "engines", "oldest_in_flight", "groups_replaced", "group_outcomes", "trajectories_failed", "migrations", "decisions", "decision_p50_us", "decision_p99_us", "messages_received", "messages_published", "failures_by_code", "turns_handed_back", "tokens_kept_on_hand_back", "invalid_results_by_engine", "engines_quarantined", "dispatch_p50_us", "dispatch_p99_us", "cpu_utilisation", "agent_calls_refused", "context_tokens_sent", "context_tokens_held", "turn_request_bytes", "turn_result_bytes", "decision_cpu_p50_us", "decision_cpu_p99_us", "agent_history_rewrites", "agent_alternatives_kept")
    class ToolCallsByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GroupOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class FailuresByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class InvalidResultsByEngineEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AgentCallsRefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRAJECTORIES_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_LAUNCHED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRAINED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    GROUP_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FAILED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    DECISION_P50_US_FIELD_NUMBER: _ClassVar[int]
    DECISION_P99_US_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    TURNS_HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_KEPT_ON_HAND_BACK_FIELD_NUMBER: _ClassVar[int]
    INVALID_RESULTS_BY_ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINES_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_P50_US_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_P99_US_FIELD_NUMBER: _ClassVar[int]
    CPU_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_CALLS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_SENT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    TURN_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    TURN_RESULT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECISION_CPU_P50_US_FIELD_NUMBER: _ClassVar[int]
    DECISION_CPU_P99_US_FIELD_NUMBER: _ClassVar[int]
    AGENT_HISTORY_REWRITES_FIELD_NUMBER: _ClassVar[int]
    AGENT_ALTERNATIVES_KEPT_FIELD_NUMBER: _ClassVar[int]
    trajectories_completed: int
    trajectories_in_flight: int
    tool_calls_by_status: _containers.ScalarMap[str, int]
    turns: int
    dropped_stale: int
    reward_mean: float
    groups_launched: int
    groups_total: int
    trained_version: int
    engines: _containers.RepeatedScalarFieldContainer[str]
    oldest_in_flight: _containers.RepeatedCompositeFieldContainer[InFlight]
    groups_replaced: int
    group_outcomes: _containers.ScalarMap[str, int]
    trajectories_failed: int
    migrations: int
    decisions: int
    decision_p50_us: float
    decision_p99_us: float
    messages_received: int
    messages_published: int
    failures_by_code: _containers.ScalarMap[str, int]
    turns_handed_back: int
    tokens_kept_on_hand_back: int
    invalid_results_by_engine: _containers.ScalarMap[str, int]
    engines_quarantined: _containers.RepeatedScalarFieldContainer[str]
    dispatch_p50_us: float
    dispatch_p99_us: float
    cpu_utilisation: float
    agent_calls_refused: _containers.ScalarMap[str, int]
    context_tokens_sent: int
    context_tokens_held: int
    turn_request_bytes: int
    turn_result_bytes: int
    decision_cpu_p50_us: float
    decision_cpu_p99_us: float
    agent_history_rewrites: int
    agent_alternatives_kept: int
    def __init__(self, trajectories_completed: _Optional[int] = ..., trajectories_in_flight: _Optional[int] = ..., tool_calls_by_status: _Optional[_Mapping[str, int]] = ..., turns: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., reward_mean: _Optional[float] = ..., groups_launched: _Optional[int] = ..., groups_total: _Optional[int] = ..., trained_version: _Optional[int] = ..., engines: _Optional[_Iterable[str]] = ..., oldest_in_flight: _Optional[_Iterable[_Union[InFlight, _Mapping]]] = ..., groups_replaced: _Optional[int] = ..., group_outcomes: _Optional[_Mapping[str, int]] = ..., trajectories_failed: _Optional[int] = ..., migrations: _Optional[int] = ..., decisions: _Optional[int] = ..., decision_p50_us: _Optional[float] = ..., decision_p99_us: _Optional[float] = ..., messages_received: _Optional[int] = ..., messages_published: _Optional[int] = ..., failures_by_code: _Optional[_Mapping[str, int]] = ..., turns_handed_back: _Optional[int] = ..., tokens_kept_on_hand_back: _Optional[int] = ..., invalid_results_by_engine: _Optional[_Mapping[str, int]] = ..., engines_quarantined: _Optional[_Iterable[str]] = ..., dispatch_p50_us: _Optional[float] = ..., dispatch_p99_us: _Optional[float] = ..., cpu_utilisation: _Optional[float] = ..., agent_calls_refused: _Optional[_Mapping[str, int]] = ..., context_tokens_sent: _Optional[int] = ..., context_tokens_held: _Optional[int] = ..., turn_request_bytes: _Optional[int] = ..., turn_result_bytes: _Optional[int] = ..., decision_cpu_p50_us: _Optional[float] = ..., decision_cpu_p99_us: _Optional[float] = ..., agent_history_rewrites: _Optional[int] = ..., agent_alternatives_kept: _Optional[int] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "state", "engine_id", "turns", "age_s", "idle_s")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    state: str
    engine_id: str
    turns: int
    age_s: float
    idle_s: float
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., state: _Optional[str] = ..., engine_id: _Optional[str] = ..., turns: _Optional[int] = ..., age_s: _Optional[float] = ..., idle_s: _Optional[float] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("run_id", "config_yaml", "config_name", "targets", "trace_dir")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    TRACE_DIR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_yaml: str
    config_name: str
    targets: _containers.RepeatedScalarFieldContainer[str]
    trace_dir: str
    def __init__(self, run_id: _Optional[str] = ..., config_yaml: _Optional[str] = ..., config_name: _Optional[str] = ..., targets: _Optional[_Iterable[str]] = ..., trace_dir: _Optional[str] = ...) -> None: ...

class JobStop(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class JobAck(_message.Message):
    __slots__ = ("worker_id", "service", "run_id", "ok", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    service: str
    run_id: str
    ok: bool
    error: ErrorInfo
    def __init__(self, worker_id: _Optional[str] = ..., service: _Optional[str] = ..., run_id: _Optional[str] = ..., ok: bool = ..., error: _Optional[_Union[ErrorInfo, _Mapping]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "service", "state", "run_id", "error", "detail", "pid", "host")
    class DetailEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    service: str
    state: str
    run_id: str
    error: ErrorInfo
    detail: _containers.ScalarMap[str, str]
    pid: int
    host: str
    def __init__(self, worker_id: _Optional[str] = ..., service: _Optional[str] = ..., state: _Optional[str] = ..., run_id: _Optional[str] = ..., error: _Optional[_Union[ErrorInfo, _Mapping]] = ..., detail: _Optional[_Mapping[str, str]] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class TrainerFacts(_message.Message):
    __slots__ = ("step", "version", "checkpoint", "trained", "trained_twice", "worker_id", "fencing_token")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TWICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    step: int
    version: int
    checkpoint: str
    trained: int
    trained_twice: int
    worker_id: str
    fencing_token: int
    def __init__(self, step: _Optional[int] = ..., version: _Optional[int] = ..., checkpoint: _Optional[str] = ..., trained: _Optional[int] = ..., trained_twice: _Optional[int] = ..., worker_id: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class SchedulerFacts(_message.Message):
    __slots__ = ("published", "trained", "dropped", "open_at_end", "lost", "lost_ids", "error", "eval_rounds", "as_of_unix")
    class EvalRoundsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    OPEN_AT_END_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    LOST_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    AS_OF_UNIX_FIELD_NUMBER: _ClassVar[int]
    published: int
    trained: int
    dropped: int
    open_at_end: int
    lost: int
    lost_ids: _containers.RepeatedScalarFieldContainer[str]
    error: str
    eval_rounds: _containers.ScalarMap[int, str]
    as_of_unix: float
    def __init__(self, published: _Optional[int] = ..., trained: _Optional[int] = ..., dropped: _Optional[int] = ..., open_at_end: _Optional[int] = ..., lost: _Optional[int] = ..., lost_ids: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., eval_rounds: _Optional[_Mapping[int, str]] = ..., as_of_unix: _Optional[float] = ...) -> None: ...

class PlannerFacts(_message.Message):
    __slots__ = ("plans", "plans_total", "role_changes", "role_changes_total")
    PLANS_FIELD_NUMBER: _ClassVar[int]
    PLANS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROLE_CHANGES_FIELD_NUMBER: _ClassVar[int]
    ROLE_CHANGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedScalarFieldContainer[str]
    plans_total: int
    role_changes: _containers.RepeatedScalarFieldContainer[str]
    role_changes_total: int
    def __init__(self, plans: _Optional[_Iterable[str]] = ..., plans_total: _Optional[int] = ..., role_changes: _Optional[_Iterable[str]] = ..., role_changes_total: _Optional[int] = ...) -> None: ...

"""`eval`, `fleet`, `curve` and `security`: the held-out evaluations, the elastic fleet,
the curve service, and who may do what."""

from __future__ import annotations

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from scalerl.config.base import _Section


class EvalConfig(_Section):
    """Held-out evaluations: the share of the run they may take, and their protocol.

    The final evaluation scores every held-out prompt; the ones in between score a fixed
    seeded subset of `prompts` prompts and start when the budget allows
    (`learner_service.evaluation.budget`): the tokens generated for them stay within
    `budget_fraction` of all tokens the workers generated. The first one (R0) scores the
    subset too unless `full_r0`; it is outside the budget either way.
    """

    budget_fraction: float = Field(
        0.15,
        description="Largest share of the generated tokens that the evaluations between "
        "R0 and the final one may take; it sets their cadence (0 < f <= 1).",
    )
    every: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description="0 = the budget sets the cadence; N = evaluate every N optimizer steps "
        "instead (a fixed schedule; the budget is then only reported).",
    )
    prompts: int = Field(
        64,
        ge=0,
        le=1_000_000,
        description="Held-out prompts of each evaluation between R0 and the final one (a "
        "fixed seeded subset, the same every time); 0 = every held-out prompt.",
    )
    full_r0: bool = Field(
        False,
        description="R0 scores every held-out prompt (as the final evaluation does) instead "
        "of the subset. Off by default: R0 then measures the same ruler as the points "
        "between, and training starts sooner (R0 holds the first weights back while it runs).",
    )
    samples: int = Field(2, ge=1, le=64, description="Samples per held-out prompt.")
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature.")
    retries: int = Field(
        3, ge=0, le=20, description="Retries of a failed evaluation before it is skipped."
    )

    @field_validator("budget_fraction")
    @classmethod
    def _check_fraction(cls, value: float) -> float:
        if not 0 < value <= 1:  # also refuses NaN
            raise ValueError(
                f"eval.budget_fraction must lie in (0, 1] (a share of the run's compute), "
                f"got {value}"
            )
        return value


class FleetConfig(_Section):
    """How many rollout workers the learner asks for (`scalerl.fleet.desired_replicas`,
    exported as `scalerl_rollout_desired_replicas`): the thresholds, hold, cooldown and
    bounds of the rule, and the window its inputs average over."""

    min_replicas: int = Field(
        1, ge=1, le=1024, description="Fewest workers it asks for (no scale-to-zero mid-run)."
    )
    max_replicas: int = Field(16, ge=1, le=1024, description="Most workers it asks for.")
    starvation_up: float = Field(
        0.25,
        gt=0,
        le=100,
        description="Learner starvation (batch-wait over step seconds) above which it asks "
        "for more workers, once held for hold_s and with free admission slots.",
    )
    throttle_down: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="Generator throttle (fraction of worker time blocked on the full replay "
        "stream) above which it asks for fewer workers, once held for hold_s.",
    )
    hold_s: float = Field(
        60.0,
        ge=0,
        le=86_400,
        description="Seconds a signal must stay past its threshold before it counts.",
    )
    cooldown_s: float = Field(
        300.0,
        ge=0,
        le=86_400,
        description="Seconds after a change before the next one; at least the time a new "
        "worker takes to load the model and register.",
    )
    max_step_up: int = Field(4, ge=1, le=1024, description="Most workers added at once.")
    max_step_down: int = Field(1, ge=1, le=1024, description="Most workers removed at once.")
    window_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="Seconds of recent steps the starvation and throttle average over.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> FleetConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"fleet.max_replicas must be >= fleet.min_replicas ({self.min_replicas}), "
                f"got {self.max_replicas}"
            )
        return self


class CurveConfig(_Section):
    """Curve service and the run's fit."""

    port: int = Field(0, ge=0, le=65_535, description="gRPC port (0 = any free port).")
    metrics_port: int = Field(0, ge=0, le=65_535, description="Prometheus port (0 = free).")


class SecurityConfig(_Section):
    """Who may change a run over gRPC, and how the connections are protected
    (`scalerl.rpc.security`). Every path is empty (= off) by default: the laptop job binds
    to 127.0.0.1 only. The token itself never sits in the config: it is read from
    `token_file`, or from the environment variable SCALERL_AUTH_TOKEN, which wins."""

    token_file: str = Field(
        "", description="File holding the run's secret, which signs privileged RPCs ('' = none)."
    )
    tls_cert_file: str = Field("", description="PEM certificate of this process's servers.")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file.")
    tls_ca_file: str = Field(
        "", description="PEM CA that signed the servers' (and clients') certificates."
    )
    require_client_cert: bool = Field(
        False, description="Mutual TLS: servers refuse clients without a certificate of the CA."
    )
    tls_server_name: str = Field(
        "",
        pattern=r"^$|^[A-Za-z0-9.-]{1,253}$",
        description="The DNS name every server's certificate holds, which clients verify "
        "instead of the address they dial (workers are dialed by pod IP); '' = the address.",
    )
    weights_root: str = Field(
        "",
        description="Folder a `uri` weight reference must lie in ('' = the run's weights "
        "folder under `scalerl run`; a worker started alone then refuses `uri` updates).",
    )
    allow_insecure: bool = Field(
        False,
        description="Let a service bind a non-loopback address without a token (every "
        "privileged RPC then open to whoever reaches the port). Off: it refuses to start.",
    )
    max_concurrent_rpcs: int = Field(
        256, ge=1, le=100_000, description="RPCs one server runs at once; more: RESOURCE_EXHAUSTED."
    )
    max_inflight_weight_bytes: int = Field(
        2 * 1024**3,
        ge=1,
        le=1024**4,
        description="Bytes of streamed UpdateWeights payloads one worker buffers at once.",
    )

    @model_validator(mode="after")
    def _check_tls(self) -> SecurityConfig:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("security.tls_cert_file and security.tls_key_file go together")
        if self.require_client_cert and not (self.tls_ca_file and self.tls_cert_file):
            raise ValueError(
                "security.require_client_cert needs security.tls_ca_file and tls_cert_file"
            )
        return self

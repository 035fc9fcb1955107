"""``WebhookSettings``: how the relay signs and delivers job webhooks (Standard Webhooks)."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

DEFAULT_RETRY_SCHEDULE_S: tuple[float, ...] = (5.0, 30.0, 120.0, 600.0, 1800.0, 7200.0)


class WebhookSettings(Block):
    """Signing secret, timeout and retry schedule of outgoing job webhooks."""

    _block_type_name = "Webhook Settings"
    _description = (
        "How FaceFlow signs (Standard Webhooks, HMAC-SHA256) and delivers job webhooks: "
        "signing secret, request timeout and retry schedule."
    )

    signing_secret: SecretStr = Field(
        description="HMAC-SHA256 signing secret, as 'whsec_<base64>' or raw text."
    )
    timeout_s: float = Field(
        default=10.0, gt=0.0, le=120.0, description="Timeout of one delivery attempt, in seconds."
    )
    retry_schedule_s: list[float] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_SCHEDULE_S),
        description="Delays before each retry after a failed delivery, in seconds.",
    )
    allow_private_addresses: bool = Field(
        default=False,
        description="Allow callbacks to loopback or private addresses (development only).",
    )

    @field_validator("retry_schedule_s")
    @classmethod
    def _non_negative_delays(cls, value: list[float]) -> list[float]:
        if any(v < 0 for v in value):
            raise ValueError("retry delays must not be negative")
        return value

    @property
    def max_attempts(self) -> int:
        """The first delivery plus one per scheduled retry."""
        return 1 + len(self.retry_schedule_s)

    def delay_before(self, attempt: int) -> float | None:
        """Seconds to wait before delivery ``attempt`` (2-based), or None when none is left."""
        index = attempt - 2
        if index < 0:
            return 0.0
        if index >= len(self.retry_schedule_s):
            return None
        return self.retry_schedule_s[index]

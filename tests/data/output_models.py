"""Pydantic models that tests' workflows name as `output:` (and things that are not models)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Weather(BaseModel):
    """A forecast; a closed model with every field required (OpenAI strict mode fits it)."""

    model_config = ConfigDict(extra="forbid")

    city: str
    temp_c: float = Field(ge=-90, le=60)
    conditions: list[str]

    @field_validator("city")
    @classmethod
    def capitalised(cls, value: str) -> str:
        if not value[:1].isupper():
            raise ValueError("a city name starts with a capital letter")
        return value


class Loose(BaseModel):
    """Open, with a default: not strict-mode material."""

    answer: str
    confidence: float = 0.5


def not_a_model() -> None:
    """A function, not a model."""


NUMBER = 3

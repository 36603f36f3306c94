"""Immutable, versioned, content-addressed artifacts. Imports nothing else of llmq."""

from .hashing import MANIFEST_NAME, content_id, sha256_file
from .manifest import KINDS, SCHEMA_VERSION
from .store import Artifact, ArtifactError, ArtifactNotFound, ArtifactWriter, ManifestDamaged, Store, default_store_path

__all__ = ["Artifact", "ArtifactError", "ArtifactNotFound", "ArtifactWriter", "KINDS", "MANIFEST_NAME",
           "ManifestDamaged", "SCHEMA_VERSION", "Store", "content_id", "default_store_path", "sha256_file"]

"""Speculative decoding: cheap proposals (n-gram lookup or a draft model) that the target verifies exactly."""

from executor.spec_decode.backoff import SpecBackoff
from executor.spec_decode.draft import DraftProposer
from executor.spec_decode.ngram import NgramProposer
from executor.spec_decode.rejection_sampler import rejection_sample, verify

__all__ = ["DraftProposer", "NgramProposer", "SpecBackoff", "rejection_sample", "verify"]

"""Prompt normalization for prefix-cache hits, and system-prompt fingerprints.

    config.py       the `normalization:` config section and the per-model/tenant override
    text.py         text rules: invisible characters, line endings, NFC, trailing whitespace
    structure.py    canonical JSON of tools and schemas; system messages first, merged
    relocate.py     dynamic content (timestamps, ids, names) out of the system prompt
    edits.py        what the rules changed
    pipeline.py     the rules in order, and `normalize`
    fingerprint.py  prefix fingerprints and the drift tracker
    stage.py        the gateway's stage: settings per model and tenant, metrics

This module imports nothing, so that `kvgate.config` can import `kvgate.normalize.config`.
"""

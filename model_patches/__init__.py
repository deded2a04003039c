"""Adapters that map each Hugging Face MoE family's expert module and checkpoint keys onto GroupedExperts."""

"""The model at run time: loading, the transformers compat layer, decoder passes over a slot-addressed
KV buffer, attention, RoPE, packed linears. Imports nothing above `fusionrag_core.errors`."""

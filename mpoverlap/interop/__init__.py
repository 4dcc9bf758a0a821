"""Conversion to and from other formats: Hugging Face model directories (export and import).

`hf_mapping`  which transformers class reproduces a model exactly (Llama, Qwen2, Qwen3, Mixtral,
              Qwen3-MoE) and its config.json (pure Python: no transformers import)
`hf_deepseek_v3`  the same for DeepseekV3ForCausalLM (latent attention, group-limited sigmoid
              routing, MTP depths in DeepSeek's layer-index layout, RoPE row order)
`hf_tensors`  the tensor-name / fused-layout mapping: each parameter as its HF parts, which are
              the blocks tensor parallelism splits (so import reads slices)
`checkpoint_reader`  a DCP checkpoint of any layout -> full tensors + model keys, one process
`hf_dir`      safetensors files (sharded, with the index json) in and out; SliceReader reads
              one rank's slice of a tensor
`export`      the `mpoverlap-export` console script
`hf_import`   `checkpoint.init_from=<hf dir>`: this rank's shards, read as slices
"""

"""Conversion to and from other formats: Hugging Face model directories (export and import).

`hf_mapping`  which transformers class reproduces a model exactly, its config.json, and the
              tensor-name / fused-layout mapping (pure Python: no transformers import)
`checkpoint_reader`  a DCP checkpoint of any layout -> full tensors + model keys, one process
`hf_dir`      safetensors files (sharded, with the index json) in and out
`export`      the `mpoverlap-export` console script
`hf_import`   `checkpoint.init_from=<hf dir>`: the full tensors the trainer reshards
"""

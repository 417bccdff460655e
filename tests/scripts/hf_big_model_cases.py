"""Big-model cases of transformers, peft and diffusers, run by tests/big_modeling/test_big_model_hf.py.

``python hf_big_model_cases.py WORKDIR OUT.json`` runs every case on whichever ``accelerate`` this
process imports (the real one, or torchbay's with ``TORCHBAY_AS_ACCELERATE=1``) and writes one
result per case: what was placed where, which modules offload, and whether the outputs equal
those of the same model without any device map. Models are tiny, random, built from configs
and saved under WORKDIR: nothing is downloaded. A case whose library is missing says so.
"""

import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

VOCAB = 128


def offloaded(model):
    return sorted(n for n, m in model.named_modules()
                  if getattr(getattr(m, "_hf_hook", None), "offload", False))


def tiny_llama(work: Path, safetensors: bool = True, name: str = "llama") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = work / (name if safetensors else f"{name}-bin")
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(path, safe_serialization=safetensors)
    return path


IDS = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))


def compare_lm(model, reference) -> dict:
    with torch.no_grad():
        got, want = model(IDS).logits, reference(IDS).logits
    mask = torch.ones_like(IDS)
    generated = model.generate(IDS, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = reference.generate(IDS, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return {"logits_equal": bool(torch.equal(got, want)), "max_diff": float((got - want).abs().max()),
            "generate_equal": bool(torch.equal(generated, expected)), "logits_sum": round(float(got.sum()), 4)}


def transformers_case(work: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    safetensors = kwargs.pop("safetensors", True)
    path = tiny_llama(work, safetensors)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    folder = tempfile.mkdtemp(dir=work)
    max_memory = kwargs.get("max_memory")
    model = AutoModelForCausalLM.from_pretrained(path, offload_folder=folder, **kwargs).eval()
    result = {"device_map": {k: str(v) for k, v in model.hf_device_map.items()}, "offloaded": offloaded(model),
              "meta_params": sorted(n for n, p in model.named_parameters() if p.is_meta),
              "max_memory_after": {str(k): v for k, v in (max_memory or {}).items()}}
    result.update(compare_lm(model, reference))
    return result


SMALL = {"cpu": "60KB"}  # the tiny model is ~200 KB: most of it goes to disk


def case_auto(work):
    return transformers_case(work, device_map="auto", max_memory=dict(SMALL))


def case_sequential(work):
    return transformers_case(work, device_map="sequential", max_memory=dict(SMALL))


def case_balanced(work):
    return transformers_case(work, device_map="balanced", max_memory=dict(SMALL))


def case_explicit_map(work):
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "disk"}
    return transformers_case(work, device_map=device_map)


def case_torch_bin_checkpoint_to_disk(work):
    """A .bin checkpoint: transformers writes the disk part into offload_folder itself."""
    return transformers_case(work, device_map="auto", max_memory=dict(SMALL), safetensors=False)


def case_peft_lora_on_dispatched_model(work):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    # peft rewrites the safetensors files of a disk-offloaded base with its own key names, in place unless the
    # folder is named as in the hub cache ("models--..."; then beside it, relative to the working directory):
    # a checkpoint of its own, named that way, keeps the other cases' checkpoint intact
    path = tiny_llama(work, name="models--tiny--llama")
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(path).eval(), config).eval()
    adapter = work / "adapter"
    reference.save_pretrained(adapter)
    folder = tempfile.mkdtemp(dir=work)
    base = AutoModelForCausalLM.from_pretrained(path, device_map="auto", max_memory=dict(SMALL),
                                                offload_folder=folder).eval()
    model = PeftModel.from_pretrained(base, adapter, max_memory=dict(SMALL),
                                      offload_folder=tempfile.mkdtemp(dir=work)).eval()
    with torch.no_grad():
        got, want = model(IDS).logits, reference(IDS).logits
    result = {"offloaded": offloaded(model), "logits_equal": bool(torch.allclose(got, want, atol=1e-6)),
              "max_diff": float((got - want).abs().max())}
    merged = model.merge_and_unload()
    reference_merged = reference.merge_and_unload()
    with torch.no_grad():
        got, want = merged(IDS).logits, reference_merged(IDS).logits
    result.update(merged_equal=bool(torch.allclose(got, want, atol=1e-5)),
                  merged_max_diff=float((got - want).abs().max()))
    return result


def case_peft_from_pretrained_with_device_map(work):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny_llama(work)
    torch.manual_seed(4)
    config = LoraConfig(r=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(path).eval(), config).eval()
    adapter = work / "adapter2"
    reference.save_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    device_map = {"": "cpu"}
    model = PeftModel.from_pretrained(base, adapter, device_map=device_map).eval()
    with torch.no_grad():
        got, want = model(IDS).logits, reference(IDS).logits
    return {"logits_equal": bool(torch.allclose(got, want, atol=1e-6)), "max_diff": float((got - want).abs().max())}


def tiny_pipeline():
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    return DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=10))


def run_pipeline(pipe):
    out = pipe(batch_size=1, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="np")
    return torch.as_tensor(out.images)


def case_diffusers_model_cpu_offload(work):
    pipe = tiny_pipeline()
    want = run_pipeline(pipe)
    pipe.enable_model_cpu_offload(device="cpu")  # no accelerator here: the cpu is the execution device
    result = {"hook": type(pipe.unet._hf_hook).__name__, "equal": bool(torch.equal(run_pipeline(pipe), want))}
    pipe.remove_all_hooks()
    result.update(hooks_left=sum(hasattr(m, "_hf_hook") for m in pipe.unet.modules()),
                  after_removal_equal=bool(torch.equal(run_pipeline(pipe), want)))
    return result


def case_diffusers_sequential_cpu_offload(work):
    pipe = tiny_pipeline()
    want = run_pipeline(pipe)
    pipe.enable_sequential_cpu_offload(device="cpu")
    result = {"offloaded": offloaded(pipe.unet), "equal": bool(torch.equal(run_pipeline(pipe), want))}
    pipe.remove_all_hooks()
    result.update(hooks_left=sum(hasattr(m, "_hf_hook") for m in pipe.unet.modules()),
                  meta_left=sum(p.is_meta for p in pipe.unet.parameters()),
                  after_removal_equal=bool(torch.equal(run_pipeline(pipe), want)))
    return result


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
NEEDS = {"peft": "peft", "diffusers": "diffusers"}


def main(work: str, out: str) -> None:
    import os

    import accelerate

    work_dir = Path(work).resolve()
    os.chdir(work_dir)  # where peft writes its rewritten offload files (see case_peft_lora_on_dispatched_model)
    results = {"accelerate": accelerate.__version__, "cases": {}}
    for name, case in CASES.items():
        library = next((lib for prefix, lib in NEEDS.items() if name.startswith(prefix)), "transformers")
        try:
            __import__(library)
        except ImportError:
            results["cases"][name] = {"skipped": f"{library} is not installed"}
            continue
        try:
            results["cases"][name] = case(work_dir)
        except Exception as exc:  # the test shows the error of the side that failed
            results["cases"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])

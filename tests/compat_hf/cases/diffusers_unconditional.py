"""A diffusers training loop as its unconditional image-generation example runs it: a tiny UNet2DModel, DDPM noise,
EMA of the weights (diffusers.training_utils.EMAModel), Accelerate's loop (accumulate, backward, clip, save_state,
load_state), then sampling with DDPMPipeline. Images are a small folder of PNGs made in this process.

``python diffusers_unconditional.py OUT_DIR RESULT.json``
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402
from common import write_result  # noqa: E402
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402
from PIL import Image  # noqa: E402


def make_image_folder(folder: str, count: int = 24, size: int = 16) -> None:
    os.makedirs(folder, exist_ok=True)
    generator = np.random.default_rng(0)
    for i in range(count):
        gradient = np.linspace(0, 255, size, dtype=np.float32)[None, :, None] * (i % 3 + 1) / 3
        noise = generator.integers(0, 32, (size, size, 3))
        pixels = np.clip(gradient + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:03d}.png"))


class ImageFolder(torch.utils.data.Dataset):
    def __init__(self, folder: str):
        self.paths = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".png"))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict:
        pixels = np.asarray(Image.open(self.paths[index]).convert("RGB"), dtype=np.float32) / 127.5 - 1.0
        return {"input": torch.from_numpy(pixels).permute(2, 0, 1)}


def main() -> None:
    out_dir, result = sys.argv[1:3]
    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="no",
                              project_config=ProjectConfiguration(project_dir=out_dir))
    images = os.path.join(out_dir, "images")
    if accelerator.is_main_process:
        make_image_folder(images)
    accelerator.wait_for_everyone()
    torch.manual_seed(0)
    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(16, 32), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    ema = EMAModel(model.parameters(), decay=0.99, model_cls=UNet2DModel, model_config=model.config)
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(ImageFolder(images), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=12)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    ema.to(accelerator.device)
    losses = []
    generator = torch.Generator().manual_seed(2)
    for epoch in range(2):
        model.train()
        for batch in loader:
            clean = batch["input"]
            noise = torch.randn(clean.shape, generator=generator)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean.shape[0],),
                                      generator=generator)
            noisy = noise_scheduler.add_noise(clean, noise, timesteps)
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(noisy, timesteps).sample, noise)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                ema.step(model.parameters())
            losses.append(round(accelerator.gather(loss.detach()).mean().item(), 6))
        accelerator.save_state(os.path.join(out_dir, f"checkpoint-{epoch}"))
    accelerator.load_state(os.path.join(out_dir, "checkpoint-0"))
    unet = accelerator.unwrap_model(model)
    ema.copy_to(unet.parameters())
    pipeline = DDPMPipeline(unet=unet, scheduler=noise_scheduler)
    sample = pipeline(generator=torch.Generator().manual_seed(3), batch_size=1, num_inference_steps=5,
                      output_type="np").images
    write_result(result, losses=losses, sample_mean=round(float(sample.mean()), 5),
                 lr=round(lr_scheduler.get_last_lr()[0], 8))
    accelerator.end_training()


if __name__ == "__main__":
    main()

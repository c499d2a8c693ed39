"""A plain PyTorch training loop: the README's "before" (hosted_loop.py is the "after")."""
import torch

from toy_model import batches, make_unet, my_loss


def main():
    unet = make_unet()
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    for batch in batches(3):
        loss = my_loss(unet, batch)
        loss.backward()
        opt.step(); opt.zero_grad()
        print(f"loss {loss.item():.6f}")


if __name__ == "__main__":
    main()

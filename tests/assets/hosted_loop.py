"""The same loop, hosted: the README's "after" (plain_loop.py is the "before")."""
import torch

from toy_model import batches, make_unet, my_loss
from runner.hosted import hosted


@hosted
def main(run):
    unet, opt, loader = run.prepare(make_unet(), None, batches(3), loss_fn=my_loss, example_batch=batches(1)[0])
    for batch in loader:
        with run.step():
            loss = my_loss(unet, batch)
            run.backward(loss)
        opt.step(); opt.zero_grad()
        print(f"loss {run.log(loss)['loss']:.6f}")


if __name__ == "__main__":
    main()

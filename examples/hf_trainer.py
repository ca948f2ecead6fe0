"""Hugging Face Trainer with vigil's callback: a heartbeat per optimizer step, and evaluation and
checkpoint phases announced before the Trainer runs them. Add to any Trainer:

    from vigil_heartbeat.integrations import hf_callback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[hf_callback()])

DeepSpeed without the Trainer:

    from vigil_heartbeat.integrations import watch_deepspeed
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)
    watch_deepspeed(engine)

Neither gives a ranking of ranks (step times are equal in synchronous training); see
docs/training.md for the StepTimer that does.
"""

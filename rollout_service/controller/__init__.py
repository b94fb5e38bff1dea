"""The rollout controller process: prompts -> G samples over N inference servers ->
rewards -> group records into the buffer, following the trainer's weight versions."""

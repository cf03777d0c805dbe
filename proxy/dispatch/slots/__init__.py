"""The slots of a backend and their order: the priority scheduler, preemption of batch
work and its resumption as one stream, the batch cap beside interactive work, agent
programs (least attained service), prefill ahead of a tool's result."""

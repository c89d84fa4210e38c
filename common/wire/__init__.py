"""What travels between the services: the messages on the Kafka topics and how they are
encoded (`messages`, over `envelope` and `job_settings`; `codec`), a job's spec and its
declared limits (`jobspec`), a job's states and the events that move it (`lifecycle`), one
version of a job's adapter as every service names it (`adapters`), the chat endpoint's
shared constants (`chat`), and how a model's turn writes a tool call (`toolcalls`). One module
owns each contract; nothing here does I/O.
"""

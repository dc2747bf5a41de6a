"""moto's server (the tests' SQS) with each queue's messages read and changed under its lock.

moto 5.2.1 receives, deletes and changes visibility without the queue's lock: two ReceiveMessage
calls at once can both hand out one message (its receive count 1 and 2), and a delete racing a
send can drop the message sent. SQS itself gives a message to one receive at a time and loses
nothing it acknowledged; the tests count both, so they run against this server.
    python3 scripts/moto_server.py -H 127.0.0.1 -p PORT
"""

import functools

from moto import server
from moto.sqs import models


def under_queue_lock(method):
    """`method` of a queue, run holding the queue's lock (a Condition over an RLock: a long poll's
    wait inside releases it)."""

    @functools.wraps(method)
    def locked(queue, *args, **kwargs):
        with queue._messages_lock:
            return method(queue, *args, **kwargs)

    return locked


def under_named_queue_lock(method):
    """`method` of the backend whose first argument names a queue, run holding that queue's lock."""

    @functools.wraps(method)
    def locked(backend, queue_name, *args, **kwargs):
        with backend.get_queue(queue_name)._messages_lock:
            return method(backend, queue_name, *args, **kwargs)

    return locked


models.Queue.delete_message = under_queue_lock(models.Queue.delete_message)
for name in ("receive_message", "change_message_visibility", "purge_queue"):
    setattr(models.SQSBackend, name, under_named_queue_lock(getattr(models.SQSBackend, name)))

if __name__ == "__main__":
    server.main()

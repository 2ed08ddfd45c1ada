"""Call records kept where a gateway replica's loss does not lose them: the bounded store
(``store.py``) and the keeper that puts a session's record there beside the conversation
(``keeper.py``). The record itself is the conversation's (``pipeline/conversation/call_record.py``)."""

"""The Python session of one doc (tests/doc_blocks.py): runs the blocks it is sent, in order,
in one namespace, and answers each on the file descriptor given as its argument.

Requests on stdin, one JSON object a line: {"code": text, "where": file name for tracebacks}.
Replies: {"ok": true} or {"ok": false, "error": the traceback}. What the blocks print goes to
stdout and stderr as usual. Ends when stdin closes."""
import json
import os
import sys
import traceback


def main() -> None:
    replies = os.fdopen(int(sys.argv[1]), "w")
    namespace = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            exec(compile(request["code"], request["where"], "exec"), namespace)
            reply = {"ok": True}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()

"""A hostile crowd for a server on loopback, run in a process of its own: `idle` connections that never send a byte
(each opened again when the server closes it), one client that trickles its headers a byte a second, and one slow
reader that asks for a long stream with its logprobs and reads a byte a second (asked again when dropped). Without
the idle and the trickler, and read at full speed, the same long stream is the crowd's fair baseline: the same work
asked of the server by a client that behaves. It records what the server answered each connection: the status
line, how the connection ended, and how long after opening."""
import asyncio
import socket
import time

READER_BODY = (b'{"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 900, '
               b'"ignore_eos": true, "stream": true, "logprobs": true, "top_logprobs": 20}')
READER = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: lab\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n%s" % (len(READER_BODY), READER_BODY))
TRICKLER = b"POST /v1/completions HTTP/1.1\r\nHost: lab\r\nX-Padding: " + b"a" * 4096
RCVBUF = 4096  # bytes: the slow reader's socket receive buffer


async def hold(port: int, send: bytes, send_every_s: float, read_every_s: float, stop: asyncio.Event,
               seen: list) -> None:
    """Open a connection; send `send` (a byte every send_every_s, or at once); read the answer's status line, then
    the rest a byte every read_every_s (0: as fast as it comes); until the server closes the connection, then again
    until `stop`. Records (status line or '', how it ended: closed, reset or error, seconds open) per connection.
    Raw sockets, read a byte at a time: a reset is seen at the next read (SO_ERROR), whatever the socket still
    holds."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        opened = time.monotonic()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)  # before connecting: the window stays small
        sock.setblocking(False)
        head, ended = b"", "closed"
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            answer = asyncio.ensure_future(loop.sock_recv(sock, 12))
            if send_every_s:
                for i in range(len(send)):
                    if answer.done():
                        break
                    await loop.sock_sendall(sock, send[i:i + 1])
                    await asyncio.sleep(send_every_s)
            else:
                await loop.sock_sendall(sock, send)
            head = await answer
            while head and await loop.sock_recv(sock, 1 if read_every_s else 65536):
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):  # reset while bytes were still unread here
                    raise ConnectionResetError
                await asyncio.sleep(read_every_s)
        except ConnectionResetError:
            ended = "reset"
        except OSError:
            ended = "error"
            await asyncio.sleep(0.5)
        finally:
            sock.close()
        seen.append((head.decode(errors="replace"), ended, round(time.monotonic() - opened, 2)))


async def crowd_async(port: int, idle: int, trickle: bool, read_every_s: float, ready, stop_flag) -> list:
    stop, seen = asyncio.Event(), []
    tasks = [asyncio.create_task(hold(port, b"", 0.0, 0.0, stop, seen)) for _ in range(idle)]
    if trickle:
        tasks.append(asyncio.create_task(hold(port, TRICKLER, 1.0, 0.0, stop, seen)))
    tasks.append(asyncio.create_task(hold(port, READER, 0.0, read_every_s, stop, seen)))
    await asyncio.sleep(2.0)  # every connection opened
    ready.set()
    while not stop_flag.is_set():
        await asyncio.sleep(0.2)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return seen


def crowd(port: int, idle: int, trickle: bool, read_every_s: float, ready, stop_flag, results) -> None:
    """The crowd (`idle` idle connections, a trickler if `trickle`, the long stream read a byte every read_every_s,
    or as fast as it comes) until `stop_flag` is set (multiprocessing events; `ready` once every connection is
    open); then hold()'s record of each connection the server closed onto `results`."""
    results.put(asyncio.run(crowd_async(port, idle, trickle, read_every_s, ready, stop_flag)))

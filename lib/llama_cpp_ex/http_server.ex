defmodule LlamaCppEx.HTTPServer do
  @moduledoc """
  An OpenAI-compatible HTTP/1.1 server on OTP's own stack (`:gen_tcp`, with the VM's HTTP
  packet parser), serving `LlamaCppEx.OpenAI` over a `LlamaCppEx.Server`, plus `GET /metrics`
  (Prometheus text, `LlamaCppEx.HTTPServer.Metrics`).

      {:ok, _} = LlamaCppEx.Server.start_link(model_path: path, name: MyApp.LLM)
      {:ok, http} = LlamaCppEx.HTTPServer.start_link(server: MyApp.LLM, port: 8080, model_name: "smollm2")

  or from a shell: `mix llama_cpp_ex.server --model PATH --port 8080`. Point any OpenAI client
  at `http://127.0.0.1:8080/v1`.

  ## Options

    * `:server` or `:cluster` (one is required), `:model_name`, `:embeddings` - as
      `LlamaCppEx.OpenAI.new/1`; with `:cluster` every request is routed to a replica of
      that `LlamaCppEx.Cluster` group, and `/metrics` sums the replicas' gauges and counters.
    * `:port` - default 8080; 0 picks a free one (`port/1` tells which).
    * `:ip` - the address to listen on. Default `{127, 0, 0, 1}`.
    * `:api_key` - when set, every request but `GET /health` needs
      `Authorization: Bearer <key>` (compared in constant time); else 401.
    * `:max_body` - largest request body in bytes, else 413. Default 8 MiB.
    * `:write_timeout` - ms a client may take to accept a write before its connection is
      closed (and its request cancelled). Default 30_000.
    * `:idle_timeout` - ms a kept-alive connection may wait for its next request. Default
      60_000.

  Streams are server-sent events (`text/event-stream`, chunked): one `data:` event per chunk,
  then `data: [DONE]`; a failure ends the stream with one `event: error` instead. A client
  that disconnects mid-stream is noticed at the next write, which halts the stream and so
  cancels its request within one tick. A full queue answers 503.
  """
  use GenServer
  require Logger

  alias LlamaCppEx.{JSON, OpenAI}
  alias LlamaCppEx.HTTPServer.Metrics

  @defaults [
    port: 8080,
    ip: {127, 0, 0, 1},
    api_key: nil,
    max_body: 8 * 1024 * 1024,
    write_timeout: 30_000,
    idle_timeout: 60_000
  ]

  @doc "Starts the listener; see the moduledoc for options."
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts) do
    {gen_opts, opts} = Keyword.split(opts, [:name])
    GenServer.start_link(__MODULE__, opts, gen_opts)
  end

  @doc "The port the server listens on."
  @spec port(GenServer.server()) :: :inet.port_number()
  def port(http), do: GenServer.call(http, :port)

  @impl true
  def init(opts) do
    opts = Keyword.merge(@defaults, opts)
    api = OpenAI.new(Keyword.take(opts, [:server, :cluster, :model_name, :embeddings]))

    listen_opts = [
      :binary,
      packet: :http_bin,
      active: false,
      reuseaddr: true,
      ip: opts[:ip],
      backlog: 1024,
      send_timeout: opts[:write_timeout],
      send_timeout_close: true
    ]

    case :gen_tcp.listen(opts[:port], listen_opts) do
      {:ok, listen} ->
        {:ok, port} = :inet.port(listen)
        {:ok, sup} = Task.Supervisor.start_link()
        metrics = Metrics.new()
        conf = %{api: api, opts: opts, metrics: metrics, sup: sup}
        acceptor = spawn_link(fn -> accept_loop(listen, conf) end)
        :ok = :gen_tcp.controlling_process(listen, acceptor)
        {:ok, %{listen: listen, port: port, acceptor: acceptor, metrics: metrics}}

      {:error, reason} ->
        {:stop, {:listen, reason}}
    end
  end

  @impl true
  def handle_call(:port, _from, st), do: {:reply, st.port, st}

  @impl true
  def terminate(_reason, st), do: :gen_tcp.close(st.listen)

  defp accept_loop(listen, conf) do
    case :gen_tcp.accept(listen) do
      {:ok, socket} ->
        {:ok, pid} =
          Task.Supervisor.start_child(conf.sup, fn ->
            receive do
              :go -> serve(socket, conf)
            end
          end)

        :ok = :gen_tcp.controlling_process(socket, pid)
        send(pid, :go)
        accept_loop(listen, conf)

      {:error, :closed} ->
        :ok

      {:error, _} ->
        accept_loop(listen, conf)
    end
  end

  ## One connection: requests one after another (keep-alive)

  defp serve(socket, conf) do
    case read_request(socket, conf) do
      {:ok, req} ->
        {status, keep?} = respond(socket, req, conf)
        Metrics.request(conf.metrics, req.path, status)
        if keep? and req.keep_alive, do: serve(socket, conf), else: :gen_tcp.close(socket)

      {:error, {:status, status, message}} ->
        send_json(socket, status, error_body(status, message), false)
        :gen_tcp.close(socket)

      {:error, _closed} ->
        :gen_tcp.close(socket)
    end
  end

  defp read_request(socket, conf) do
    :inet.setopts(socket, packet: :http_bin)

    case :gen_tcp.recv(socket, 0, conf.opts[:idle_timeout]) do
      {:ok, {:http_request, method, {:abs_path, target}, version}} ->
        with {:ok, headers} <- read_headers(socket, %{}) do
          {path, _query} = split_query(target)

          req = %{
            method: to_string(method),
            path: path,
            headers: headers,
            keep_alive: keep_alive?(version, headers)
          }

          with {:ok, body} <- read_body(socket, headers, conf.opts[:max_body]),
               do: {:ok, Map.put(req, :body, body)}
        end

      {:ok, {:http_request, _, _, _}} ->
        {:error, {:status, 400, "unsupported request target"}}

      {:ok, {:http_error, _}} ->
        {:error, {:status, 400, "malformed request"}}

      {:error, reason} ->
        {:error, reason}
    end
  end

  defp read_headers(socket, acc) do
    case :gen_tcp.recv(socket, 0, 10_000) do
      {:ok, {:http_header, _, name, _, value}} when map_size(acc) < 100 ->
        read_headers(socket, Map.put(acc, String.downcase(to_string(name)), value))

      {:ok, :http_eoh} ->
        {:ok, acc}

      {:ok, _} ->
        {:error, {:status, 400, "malformed headers"}}

      {:error, reason} ->
        {:error, reason}
    end
  end

  defp read_body(socket, headers, max) do
    cond do
      headers["transfer-encoding"] != nil ->
        {:error, {:status, 411, "send the body with a Content-Length"}}

      headers["content-length"] in [nil, "0"] ->
        {:ok, ""}

      true ->
        case Integer.parse(headers["content-length"]) do
          {n, ""} when n > max ->
            {:error, {:status, 413, "request body over #{max} bytes"}}

          {n, ""} when n >= 0 ->
            :inet.setopts(socket, packet: :raw)

            case :gen_tcp.recv(socket, n, 30_000) do
              {:ok, body} -> {:ok, body}
              {:error, reason} -> {:error, reason}
            end

          _ ->
            {:error, {:status, 400, "bad Content-Length"}}
        end
    end
  end

  defp split_query(target) do
    case String.split(target, "?", parts: 2) do
      [path, q] -> {path, q}
      [path] -> {path, ""}
    end
  end

  defp keep_alive?({1, 1}, headers), do: String.downcase(headers["connection"] || "") != "close"
  defp keep_alive?(_, headers), do: String.downcase(headers["connection"] || "") == "keep-alive"

  ## Responses

  defp respond(socket, req, conf) do
    cond do
      not authorized?(req, conf.opts[:api_key]) ->
        send_json(socket, 401, error_body(401, "invalid or missing API key"), req.keep_alive)

      req.method == "GET" and req.path == "/metrics" ->
        text = Metrics.render(conf.metrics, OpenAI.servers(conf.api))
        send_raw(socket, 200, "text/plain; version=0.0.4", text, req.keep_alive)

      true ->
        case decode(req) do
          {:ok, body} ->
            answer(socket, OpenAI.handle(conf.api, req.method, req.path, body), req, conf)

          {:error, message} ->
            send_json(socket, 400, error_body(400, message), req.keep_alive)
        end
    end
  end

  defp authorized?(_req, nil), do: true
  defp authorized?(%{method: "GET", path: "/health"}, _key), do: true

  defp authorized?(req, key) do
    given =
      case req.headers["authorization"] do
        "Bearer " <> k -> String.trim(k)
        _ -> ""
      end

    # equal lengths for the constant-time comparison
    byte_size(given) == byte_size(key) and :crypto.hash_equals(given, key)
  end

  defp decode(%{method: "GET"}), do: {:ok, nil}
  defp decode(%{body: ""}), do: {:ok, %{}}

  defp decode(%{body: body}) do
    case JSON.decode(body) do
      {:ok, %{} = map} -> {:ok, map}
      {:ok, _} -> {:error, "the body must be a JSON object"}
      {:error, why} -> {:error, "malformed JSON: #{why}"}
    end
  end

  defp answer(socket, {:json, status, body}, req, _conf),
    do: send_json(socket, status, body, req.keep_alive)

  defp answer(socket, {:sse, events}, req, conf) do
    head = [
      "HTTP/1.1 200 OK\r\n",
      "content-type: text/event-stream\r\n",
      "cache-control: no-cache\r\n",
      "transfer-encoding: chunked\r\n",
      if(req.keep_alive, do: "", else: "connection: close\r\n"),
      "\r\n"
    ]

    with :ok <- :gen_tcp.send(socket, head) do
      started = System.monotonic_time()

      # halting the enumeration (a write failed: the client left) closes the stream, which
      # cancels its request
      result =
        Enum.reduce_while(events, {:ok, nil}, fn event, {_, last} ->
          last = note_token(conf.metrics, event, last, started)

          case chunk(socket, OpenAI.sse(event)) do
            :ok when elem(event, 0) == :error -> {:halt, {:failed, last}}
            :ok -> {:cont, {:ok, last}}
            {:error, _} = closed -> {:halt, closed}
          end
        end)

      case result do
        {:error, _} -> {499, false}
        {:failed, _} -> finish_chunks(socket, [], req)
        {:ok, _} -> finish_chunks(socket, [OpenAI.sse(:done)], req)
      end
    else
      _ -> {499, false}
    end
  end

  # time to the first content event, then the gaps between content events
  defp note_token(metrics, {:data, chunk}, last, started) do
    if content?(chunk) do
      now = System.monotonic_time()
      Metrics.token_gap(metrics, now - (last || started), last == nil)
      now
    else
      last
    end
  end

  defp note_token(_metrics, _event, last, _started), do: last

  defp content?(%{choices: [%{delta: d} | _]}),
    do: Map.get(d, :content, "") not in ["", nil] or Map.has_key?(d, :tool_calls)

  defp content?(%{choices: [%{text: t} | _]}), do: t != ""
  defp content?(_), do: false

  defp finish_chunks(socket, tail, req) do
    case :gen_tcp.send(socket, [Enum.map(tail, &chunk_bytes/1), "0\r\n\r\n"]) do
      :ok -> {200, req.keep_alive}
      _ -> {499, false}
    end
  end

  defp chunk(socket, data), do: :gen_tcp.send(socket, chunk_bytes(data))

  defp chunk_bytes(data) do
    size = IO.iodata_length(data)
    [Integer.to_string(size, 16), "\r\n", data, "\r\n"]
  end

  defp send_json(socket, status, body, keep_alive) do
    send_raw(socket, status, "application/json", JSON.encode!(body), keep_alive)
  end

  defp send_raw(socket, status, type, body, keep_alive) do
    head = [
      "HTTP/1.1 ",
      Integer.to_string(status),
      " ",
      reason(status),
      "\r\ncontent-type: ",
      type,
      "\r\ncontent-length: ",
      Integer.to_string(IO.iodata_length(body)),
      if(keep_alive, do: "", else: "\r\nconnection: close"),
      "\r\n\r\n"
    ]

    case :gen_tcp.send(socket, [head, body]) do
      :ok -> {status, keep_alive}
      _ -> {status, false}
    end
  end

  defp error_body(status, message) do
    {:json, _, body} =
      OpenAI.error(
        status,
        message,
        if(status == 401, do: "authentication_error", else: "invalid_request_error")
      )

    body
  end

  defp reason(200), do: "OK"
  defp reason(400), do: "Bad Request"
  defp reason(401), do: "Unauthorized"
  defp reason(404), do: "Not Found"
  defp reason(411), do: "Length Required"
  defp reason(413), do: "Payload Too Large"
  defp reason(500), do: "Internal Server Error"
  defp reason(503), do: "Service Unavailable"
  defp reason(504), do: "Gateway Timeout"
  defp reason(_), do: "Status"
end

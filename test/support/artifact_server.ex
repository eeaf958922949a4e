defmodule LlamaCppEx.Test.ArtifactServer do
  @moduledoc false
  # An HTTP/1.1 server on 127.0.0.1 for the precompiled-NIF tests. Routes map a path to
  # `{status, body}` or `{:truncate, body, claimed_length}` (sends `body` under a larger
  # Content-Length, then closes). It counts the requests it answered, and also acts as an
  # HTTP proxy (absolute URLs are routed by their path).

  # `tls`: nil for plain HTTP, or `:ssl` server options (cert, key) for HTTPS on localhost.
  def start(routes, tls \\ nil) do
    {:ok, agent} = Agent.start_link(fn -> %{routes: routes, requests: 0, proxied: []} end)
    base = [:binary, active: false, reuseaddr: true, ip: {127, 0, 0, 1}]

    {transport, {:ok, listen}} =
      if tls,
        do: {:ssl, :ssl.listen(0, base ++ tls)},
        else: {:gen_tcp, :gen_tcp.listen(0, base)}

    {:ok, {_, port}} =
      if transport == :ssl, do: :ssl.sockname(listen), else: :inet.sockname(listen)

    acceptor = spawn_link(fn -> accept(transport, listen, agent) end)
    :ok = transport.controlling_process(listen, acceptor)
    url = if tls, do: "https://localhost:#{port}", else: "http://127.0.0.1:#{port}"
    %{port: port, agent: agent, listen: listen, transport: transport, url: url}
  end

  def requests(%{agent: agent}), do: Agent.get(agent, & &1.requests)

  @doc "Hosts of the absolute URLs it was asked for as a proxy."
  def proxied(%{agent: agent}), do: Agent.get(agent, & &1.proxied)

  def put(%{agent: agent}, path, answer),
    do: Agent.update(agent, fn s -> put_in(s, [:routes, path], answer) end)

  def stop(%{listen: listen, transport: t}), do: t.close(listen)

  defp accept(t, listen, agent) do
    case if(t == :ssl, do: :ssl.transport_accept(listen), else: :gen_tcp.accept(listen)) do
      {:ok, socket} ->
        # a failed TLS handshake (a client that does not trust the certificate) ends here
        with {:ok, socket} <- handshake(t, socket), do: serve(t, socket, agent)
        accept(t, listen, agent)

      {:error, :closed} ->
        :ok

      {:error, _} ->
        accept(t, listen, agent)
    end
  end

  defp handshake(:ssl, socket), do: :ssl.handshake(socket, 5_000)
  defp handshake(:gen_tcp, socket), do: {:ok, socket}

  defp serve(t, socket, agent) do
    with {:ok, request} <- read_head(t, socket, ""),
         [_method, target | _] <- String.split(request, " ", parts: 3) do
      # a proxy is asked for the absolute URL; route by its path and remember the host
      %URI{path: path, host: host} = URI.parse(target)

      answer =
        Agent.get_and_update(agent, fn s ->
          {Map.get(s.routes, path, {404, "not found"}),
           %{s | requests: s.requests + 1, proxied: s.proxied ++ List.wrap(host)}}
        end)

      t.send(socket, response(answer))
    end

    t.close(socket)
  end

  defp read_head(t, socket, acc) do
    if String.contains?(acc, "\r\n\r\n") do
      {:ok, acc}
    else
      case t.recv(socket, 0, 5_000) do
        {:ok, data} -> read_head(t, socket, acc <> data)
        error -> error
      end
    end
  end

  defp response({:truncate, body, claimed}), do: head(200, claimed) <> body
  defp response({status, body}), do: head(status, byte_size(body)) <> body

  defp head(status, length),
    do:
      "HTTP/1.1 #{status} X\r\ncontent-length: #{length}\r\nconnection: close\r\n" <>
        "content-type: application/octet-stream\r\n\r\n"
end

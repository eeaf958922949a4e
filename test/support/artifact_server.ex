defmodule LlamaCppEx.Test.ArtifactServer do
  @moduledoc false
  # An HTTP/1.1 server on 127.0.0.1 for the precompiled-NIF tests. Routes map a path to
  # `{status, body}` or `{:truncate, body, claimed_length}` (sends `body` under a larger
  # Content-Length, then closes). It counts the requests it answered, and also acts as an
  # HTTP proxy (absolute URLs are routed by their path).

  def start(routes) do
    {:ok, agent} = Agent.start_link(fn -> %{routes: routes, requests: 0, proxied: []} end)

    {:ok, listen} =
      :gen_tcp.listen(0, [:binary, active: false, reuseaddr: true, ip: {127, 0, 0, 1}])

    {:ok, port} = :inet.port(listen)
    acceptor = spawn_link(fn -> accept(listen, agent) end)
    :ok = :gen_tcp.controlling_process(listen, acceptor)
    %{port: port, agent: agent, listen: listen, url: "http://127.0.0.1:#{port}"}
  end

  def requests(%{agent: agent}), do: Agent.get(agent, & &1.requests)

  @doc "Hosts of the absolute URLs it was asked for as a proxy."
  def proxied(%{agent: agent}), do: Agent.get(agent, & &1.proxied)

  def put(%{agent: agent}, path, answer),
    do: Agent.update(agent, fn s -> put_in(s, [:routes, path], answer) end)

  def stop(%{listen: listen}), do: :gen_tcp.close(listen)

  defp accept(listen, agent) do
    case :gen_tcp.accept(listen) do
      {:ok, socket} ->
        serve(socket, agent)
        accept(listen, agent)

      {:error, _closed} ->
        :ok
    end
  end

  defp serve(socket, agent) do
    with {:ok, request} <- read_head(socket, ""),
         [_method, target | _] <- String.split(request, " ", parts: 3) do
      # a proxy is asked for the absolute URL; route by its path and remember the host
      %URI{path: path, host: host} = URI.parse(target)

      answer =
        Agent.get_and_update(agent, fn s ->
          {Map.get(s.routes, path, {404, "not found"}),
           %{s | requests: s.requests + 1, proxied: s.proxied ++ List.wrap(host)}}
        end)

      :gen_tcp.send(socket, response(answer))
    end

    :gen_tcp.close(socket)
  end

  defp read_head(socket, acc) do
    if String.contains?(acc, "\r\n\r\n") do
      {:ok, acc}
    else
      case :gen_tcp.recv(socket, 0, 5_000) do
        {:ok, data} -> read_head(socket, acc <> data)
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

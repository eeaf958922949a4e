defmodule LlamaCppEx.Test.HubServer do
  @moduledoc """
  A stand-in for the Hugging Face Hub on 127.0.0.1, for `LlamaCppEx.Hub`'s tests: it serves
  the Hub's routes for the repositories it is started with.

    * `GET /api/models/<repo>/revision/<rev>` — `{id, sha, siblings: [{rfilename, size,
      lfs: {sha256, size}}]}` (no `lfs` for files marked `lfs: false`)
    * `GET /api/models/<repo>/tree/<rev>` — `[{type, path, size, oid}]`
    * `GET /api/models?search=…` — the repositories whose id contains the query
    * `GET /<repo>/resolve/<rev>/<file>` — the bytes, with `ETag`, `X-Linked-Etag`,
      `X-Repo-Commit`, `Content-Length` and `Accept-Ranges`; honours `Range: bytes=N-`

  Files are `%{name => %{body: binary}}` with optional `:sha256` (what the metadata
  announces, to simulate corruption), `lfs: false`, `truncate: n` (announce the full length,
  send n bytes, close) and repositories may need a token (`token: "secret"` → 401 without
  it). Every request is recorded (`requests/1`).
  """

  use GenServer

  @doc "Starts a server for `repos` (`%{repo_id => %{files: …, token: …}}`); `{pid, url}`."
  def start(repos) do
    {:ok, pid} = GenServer.start(__MODULE__, repos)
    {pid, "http://127.0.0.1:#{GenServer.call(pid, :port)}"}
  end

  def stop(pid), do: GenServer.stop(pid)

  @doc "The request paths served so far, oldest first."
  def requests(pid), do: GenServer.call(pid, :requests)

  @impl true
  def init(repos) do
    {:ok, listen} =
      :gen_tcp.listen(0, [:binary, active: false, reuseaddr: true, ip: {127, 0, 0, 1}])

    {:ok, port} = :inet.port(listen)
    me = self()
    spawn_link(fn -> accept(listen, repos, me) end)
    {:ok, %{listen: listen, port: port, requests: []}}
  end

  @impl true
  def handle_call(:port, _from, s), do: {:reply, s.port, s}
  def handle_call(:requests, _from, s), do: {:reply, Enum.reverse(s.requests), s}

  @impl true
  def handle_info({:request, path}, s), do: {:noreply, %{s | requests: [path | s.requests]}}

  defp accept(listen, repos, owner) do
    case :gen_tcp.accept(listen) do
      {:ok, socket} ->
        pid = spawn(fn -> serve(socket, repos, owner) end)
        :gen_tcp.controlling_process(socket, pid)
        send(pid, :go)
        accept(listen, repos, owner)

      {:error, _} ->
        :ok
    end
  end

  defp serve(socket, repos, owner) do
    receive do
      :go -> :ok
    end

    case read_request(socket, "") do
      {:ok, path, headers} ->
        send(owner, {:request, path})
        respond(socket, route(path, headers, repos))

      :error ->
        :ok
    end

    :gen_tcp.close(socket)
  end

  defp read_request(socket, acc) do
    case :binary.split(acc, "\r\n\r\n") do
      [head, _rest] ->
        [request_line | lines] = String.split(head, "\r\n")
        [_method, path | _] = String.split(request_line, " ")

        headers =
          Map.new(lines, fn l ->
            [k, v] = String.split(l, ":", parts: 2)
            {String.downcase(k), String.trim(v)}
          end)

        {:ok, path, headers}

      [_] ->
        case :gen_tcp.recv(socket, 0, 5_000) do
          {:ok, data} -> read_request(socket, acc <> data)
          {:error, _} -> :error
        end
    end
  end

  defp route(path, headers, repos) do
    %URI{path: p, query: q} = URI.parse(path)
    query = URI.decode_query(q || "")

    cond do
      p == "/api/models" ->
        hits =
          for {id, _} <- repos,
              String.contains?(id, query["search"] || ""),
              do: %{"id" => id, "downloads" => 7, "likes" => 1, "tags" => ["gguf"]}

        json(200, hits)

      String.starts_with?(p, "/api/models/") ->
        api(String.trim_leading(p, "/api/models/"), headers, repos)

      String.contains?(p, "/resolve/") ->
        [repo, rest] = String.split(String.trim_leading(p, "/"), "/resolve/", parts: 2)
        [_rev, file] = String.split(rest, "/", parts: 2)
        resolve(repos[repo], URI.decode(file), headers)

      true ->
        {404, [], "not found"}
    end
  end

  defp api(rest, headers, repos) do
    {repo, kind} =
      cond do
        String.contains?(rest, "/revision/") -> {hd(String.split(rest, "/revision/")), :revision}
        String.contains?(rest, "/tree/") -> {hd(String.split(rest, "/tree/")), :tree}
        true -> {rest, :revision}
      end

    case repos[repo] do
      nil ->
        json(404, %{"error" => "Repository not found"})

      r ->
        if authorized?(r, headers) do
          json(200, listing(repo, r, kind))
        else
          json(401, %{"error" => "Invalid credentials"})
        end
    end
  end

  defp listing(repo, r, :revision) do
    siblings =
      for {name, f} <- r.files do
        base = %{"rfilename" => name, "size" => byte_size(f.body)}

        if Map.get(f, :lfs, true),
          do: Map.put(base, "lfs", %{"sha256" => sha(f), "size" => byte_size(f.body)}),
          else: base
      end

    %{"id" => repo, "sha" => commit(), "siblings" => siblings}
  end

  defp listing(_repo, r, :tree) do
    for {name, f} <- r.files,
        do: %{"type" => "file", "path" => name, "size" => byte_size(f.body), "oid" => "x"}
  end

  defp resolve(nil, _file, _headers), do: {404, [{"x-error-code", "RepoNotFound"}], "no repo"}

  defp resolve(r, file, headers) do
    f = r.files[file]

    cond do
      not authorized?(r, headers) ->
        {401, [], "unauthorized"}

      f == nil ->
        {404, [{"x-error-code", "EntryNotFound"}], "no such file"}

      true ->
        body = f.body
        etag = ~s("#{sha(f)}")

        base = [
          {"etag", etag},
          {"x-linked-etag", etag},
          {"x-repo-commit", commit()},
          {"accept-ranges", "bytes"}
        ]

        case headers["range"] do
          "bytes=" <> spec ->
            from = spec |> String.trim_trailing("-") |> String.to_integer()
            part = binary_part(body, from, byte_size(body) - from)

            {206,
             base ++
               [{"content-range", "bytes #{from}-#{byte_size(body) - 1}/#{byte_size(body)}"}],
             part}

          _ ->
            case Map.get(f, :truncate) do
              nil -> {200, base, body}
              n -> {:truncated, base, body, n}
            end
        end
    end
  end

  defp authorized?(%{token: token}, headers) when is_binary(token),
    do: headers["authorization"] == "Bearer " <> token

  defp authorized?(_, _), do: true

  defp sha(f),
    do: Map.get(f, :sha256) || Base.encode16(:crypto.hash(:sha256, f.body), case: :lower)

  defp commit, do: String.duplicate("ab", 20)

  defp json(status, term),
    do: {status, [{"content-type", "application/json"}], LlamaCppEx.JSON.encode!(term)}

  defp respond(socket, {:truncated, headers, body, n}) do
    :gen_tcp.send(socket, head(200, headers, byte_size(body)))
    :gen_tcp.send(socket, binary_part(body, 0, n))
  end

  defp respond(socket, {status, headers, body}) do
    :gen_tcp.send(socket, [head(status, headers, byte_size(body)), body])
  end

  defp head(status, headers, length) do
    lines =
      for {k, v} <- headers ++ [{"content-length", "#{length}"}, {"connection", "close"}],
          do: "#{k}: #{v}\r\n"

    ["HTTP/1.1 #{status} X\r\n", lines, "\r\n"]
  end
end

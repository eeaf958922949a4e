defmodule LlamaCppEx.Hub.Cache do
  @moduledoc false
  # Where the Hub's files live and how they are written: cache paths guarded against escaping
  # the cache directory, private directories and files, exclusive `.part` files renamed into
  # place once verified, and the offline switch.

  @doc "`<cache_dir>/<repo_id>/<revision>/<filename>`; raises `ArgumentError` for values that could leave it."
  def path(repo_id, filename, opts) do
    rev = Keyword.get(opts, :revision, "main")
    validate_component!(repo_id, "repository id")
    validate_component!(filename, "filename")
    validate_component!(rev, "revision")
    Path.join([cache_dir(opts), repo_id, rev, filename])
  end

  def guard_path(repo_id, filename, opts) do
    {:ok, path(repo_id, filename, opts)}
  rescue
    e in ArgumentError -> {:error, Exception.message(e)}
  end

  def guard(fun) do
    fun.()
    :ok
  rescue
    e in ArgumentError -> {:error, Exception.message(e)}
  end

  def validate_component!(value, what) when not is_binary(value),
    do: raise(ArgumentError, "invalid #{what} #{inspect(value)}: expected a string")

  def validate_component!("", what),
    do: raise(ArgumentError, "invalid #{what}: must not be empty")

  def validate_component!(value, what) do
    bad =
      cond do
        String.contains?(value, <<0>>) -> "contains a null byte"
        String.contains?(value, "\\") -> "contains a backslash"
        String.starts_with?(value, "/") -> "is an absolute path"
        Regex.match?(~r/^[A-Za-z]:/, value) -> "starts with a drive letter"
        String.contains?(value, "//") -> "contains an empty component"
        true -> bad_component(String.split(value, "/"))
      end

    if bad, do: raise(ArgumentError, "invalid #{what} #{inspect(value)}: #{bad}")
    :ok
  end

  defp bad_component(parts) do
    Enum.find_value(parts, fn
      "" -> "contains an empty component"
      "." -> "contains a \".\" component"
      ".." -> "contains a \"..\" component"
      "~" <> _ -> "contains a \"~\" component"
      _ -> nil
    end)
  end

  defp cache_dir(opts) do
    Keyword.get(opts, :cache_dir) || env("LLAMA_CACHE_DIR") ||
      Path.join(System.user_home!(), ".cache/llama_cpp_ex/models")
  end

  @doc "A fresh `.part` path next to `dest`."
  def part_path(dest), do: dest <> "." <> random_suffix() <> ".part"

  defp random_suffix, do: Base.url_encode64(:crypto.strong_rand_bytes(16), padding: false)

  def mkdir_private(dir) do
    # every directory created on the way gets 0700
    dir
    |> Path.split()
    |> Enum.scan(&Path.join(&2, &1))
    |> Enum.each(fn d ->
      unless File.dir?(d) do
        File.mkdir(d)
        File.chmod(d, 0o700)
      end
    end)

    :ok
  end

  def open_exclusive(path) do
    case File.open(path, [:read, :write, :exclusive, :binary, :raw]) do
      {:ok, io} ->
        File.chmod(path, 0o600)
        {:ok, io}

      {:error, reason} ->
        {:error, "cannot create #{path}: #{:file.format_error(reason)}"}
    end
  end

  def write_etag(dest, headers) do
    case LlamaCppEx.Hub.HTTP.header(headers, "x-linked-etag") ||
           LlamaCppEx.Hub.HTTP.header(headers, "etag") do
      nil ->
        :ok

      etag ->
        path = dest <> ".etag"
        File.write(path, etag)
        File.chmod(path, 0o600)
    end
  end

  def offline?, do: env("LLAMA_OFFLINE") in ["1", "true"]

  defp env(name), do: LlamaCppEx.Hub.HTTP.env(name)
end
